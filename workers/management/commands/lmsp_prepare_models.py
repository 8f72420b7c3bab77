from django.core.management.base import BaseCommand

from generation.registry import available_models, declared_models
from generation.weights import weights_folder


class Command(BaseCommand):
    help = "Convert each available model's weights once into the model cache."

    def handle(self, *args: object, **options: object) -> None:
        for model_id, spec in declared_models().items():
            if model_id not in available_models():
                self.stdout.write(f"{model_id}: weights not on this machine, skipped")
                continue
            self.stdout.write(f"{model_id}: ready in {weights_folder(spec)}")
