"""The ASGI application: Django behind the body limit and upload timeout
(``lmsp_core.asgi.BoundedBody``), which act before Django reads a byte and
answer in the shape of the API the path belongs to."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

django_application = get_asgi_application()

from lmsp_core.asgi import BoundedBody  # noqa: E402 - needs the settings configured
from openai_app.errors import error_body  # noqa: E402

application = BoundedBody(django_application, shapes={"/v1/": error_body})
