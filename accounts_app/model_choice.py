"""The admin's field for the models an owner or a token may use
(``OwnerQuota.allowed_models``, ``ApiToken.allowed_models``): a box per model
that ``models.toml`` declares, so that only real ids are stored, and none
ticked stores null: no restriction. (To let an owner use nothing at all,
deactivate its account.)"""

from __future__ import annotations

from typing import Any

from django import forms

from generation.registry import declared_models


def _declared() -> list[tuple[str, str]]:
    return [(model_id, model_id) for model_id in declared_models()]


class AllowedModelsField(forms.MultipleChoiceField):
    def __init__(self, help_text: str, **kwargs: Any) -> None:
        super().__init__(
            choices=_declared,
            required=False,
            widget=forms.CheckboxSelectMultiple,
            help_text=help_text,
            **kwargs,
        )

    def clean(self, value: Any) -> list[str] | None:
        return super().clean(value) or None
