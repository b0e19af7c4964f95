"""This process's weights store and router, built once from Django settings.

Every process (web, Celery worker, a gateway) that assigns users embeds one Router: it loads
all experiments' weights documents and follows changes with a watch.
"""

from __future__ import annotations

import threading

from django.conf import settings

from experiments.weights.factory import store_from_config
from experiments.weights.router import Router
from experiments.weights.store import WeightsStore

_lock = threading.Lock()
_store: WeightsStore | None = None
_router: Router | None = None


def weights_store() -> WeightsStore:
    global _store
    with _lock:
        if _store is None:
            _store = store_from_config(
                settings.ETCD_ENDPOINTS,
                settings.ETCD_PREFIX,
                str(settings.WEIGHTS_DIR),
                ca_cert=settings.ETCD_CA_CERT,
                cert=settings.ETCD_CERT,
                key=settings.ETCD_KEY,
                user=settings.ETCD_USER,
                password=settings.ETCD_PASSWORD,
            )
        return _store


def live_router(wait: float = 5.0) -> Router:
    """The process-wide router, started on first use (waits up to ``wait`` s for the first load)."""
    global _router
    store = weights_store()
    with _lock:
        if _router is None:
            _router = Router(store)
            _router.start(wait=wait)
        return _router


def reset_for_tests() -> None:
    global _store, _router
    with _lock:
        if _router is not None:
            _router.stop()
        if _store is not None:
            _store.close()
        _store = _router = None
