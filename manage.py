#!/usr/bin/env python
"""abplat's command line: python manage.py <command>."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
    # The development settings file (.env beside this file, `make dev-env`), under what the
    # environment already sets: abplat/env.py. (Importing abplat loads the Celery app, which
    # reads it too: the same file, read once into the environment.)
    from abplat.env import EnvError, load_env_file

    try:
        load_env_file(os.environ)
    except EnvError as exc:
        sys.exit(f"abplat: configuration error: {exc}")

    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    from abplat.config import require_secret_key

    try:
        settings.INSTALLED_APPS  # noqa: B018 - loads the settings: a bad variable stops here
        if sys.argv[1:2] == ["runserver"] and not {"-h", "--help"} & set(sys.argv[2:]):
            require_secret_key()  # a web process: sessions and CSRF sign with the key
    except ImproperlyConfigured as exc:
        # The message names the variable and what it accepts; a traceback would bury it.
        sys.exit(f"abplat: configuration error: {exc}")

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
