from typing import NoReturn

from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.http import HttpRequest
from django.urls import include, path, re_path

from lmsp_core.errors import ProblemError
from lmsp_core.http import csrf_free
from ops_app import views as ops
from ops_app.usage_api import UsageView
from playground_app import views as playground
from responses_app import views as responses
from tasks_app import views as tasks

from .openapi import openapi_json


@csrf_free
def api_not_found(request: HttpRequest, *args: object, **kwargs: object) -> NoReturn:
    raise ProblemError("not_found", f"There is nothing at {request.path}.")


api = "lmsp/v1/"
urlpatterns = [
    path("metrics", ops.metrics),
    path("livez", ops.livez),
    path("readyz", ops.readyz),
    path("healthz", ops.readyz),  # the name compose files and older checks use
    path("admin/lmsp/", include("ops_app.admin_views")),
    path("admin/", admin.site.urls),
    path("playground/", playground.playground, name="playground"),
    path("playground/session-token", playground.session_token, name="playground-session-token"),
    # The admin's CSS and scripts, from the installed apps, without a separate
    # file server or collectstatic step: the only static files are the admin's,
    # for a handful of staff users.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
    path(f"{api}openapi.json", openapi_json),
    path(f"{api}models", responses.ModelListView.as_view()),
    path(f"{api}models/<path:model_id>", responses.ModelDetailView.as_view()),
    path(f"{api}responses", responses.create_response),
    path(f"{api}responses/<str:response_id>", responses.ResponseDetailView.as_view()),
    path(f"{api}tasks", tasks.TaskCollectionView.as_view()),
    path(f"{api}tasks/<str:task_id>", tasks.TaskDetailView.as_view()),
    path(f"{api}tasks/<str:task_id>/cancel", tasks.TaskCancelView.as_view()),
    path(f"{api}tasks/<str:task_id>/events", tasks.task_events),
    path(f"{api}usage", UsageView.as_view()),
    path(f"{api}tasks/<str:task_id>/stream-url", tasks.TaskStreamUrlView.as_view()),
    re_path(r"^lmsp/", api_not_found),
    # OpenAI-compatible API (openai_app): the same service in OpenAI's shapes
    path("v1/", include("openai_app.urls")),
]
