"""Routes of the OpenAI-compatible API, mounted at ``/v1/`` by the project."""

from django.urls import path, re_path

from . import views

urlpatterns = [
    path("models", views.model_list),
    path("models/<path:model_id>", views.model_detail),
    path("chat/completions", views.chat_completions),
    path("responses", views.create_response),
    path("responses/<str:response_id>", views.response_detail),
    path("responses/<str:response_id>/cancel", views.cancel_response),
    re_path(r"^.*$", views.not_found),
]
