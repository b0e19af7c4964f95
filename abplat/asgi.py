"""The ASGI application of the web app. It refuses to load without a secret key when debug is
off, as abplat/wsgi.py does."""

import os

from django.core.asgi import get_asgi_application

from abplat.config import require_secret_key

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
require_secret_key()
application = get_asgi_application()
