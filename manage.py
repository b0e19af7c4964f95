#!/usr/bin/env python
"""abplat's command line: python manage.py <command>."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        settings.INSTALLED_APPS  # noqa: B018 - loads the settings: a bad variable stops here
    except ImproperlyConfigured as exc:
        # The message names the variable and what it accepts; a traceback would bury it.
        sys.exit(f"abplat: configuration error: {exc}")

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
