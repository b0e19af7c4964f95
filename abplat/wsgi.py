"""The WSGI application of the web process (gunicorn.conf.py, docs/deploy.md). It refuses to
load without a secret key when debug is off: a web process signs sessions and forms with it."""

import os

from django.core.wsgi import get_wsgi_application

from abplat.config import require_secret_key

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
require_secret_key()
application = get_wsgi_application()
