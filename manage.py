#!/usr/bin/env python
"""Django's command-line utility, pointed at this checkout's embedded services
when DATABASE_URL is unset (see lmsp_project/localservices.py)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    from lmsp_project.localservices import prepare_manage_py

    prepare_manage_py(sys.argv)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
