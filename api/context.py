"""What every request of one API process shares: settings, the store, keys, ownership
checks, leasing and the capture gateway. Built once per process by ``api.app.create_app``."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from api.access import Access
from api.keys import ApiKey, KeyStore
from api.places import ProjectPlaces
from store.eventlog import EventStore
from store.leasing import Leasing
from store.settings import Settings

if TYPE_CHECKING:
    from api.derive_slots import DeriveSlots
    from api.gateway.service import Gateway

__all__ = ["ApiContext"]

_DERIVES_LOCK = threading.Lock()


@dataclass
class ApiContext:
    """Shared state of one API process. ``gateway`` is built on first use."""

    settings: Settings
    store: EventStore
    keys: KeyStore
    access: Access
    leasing: Leasing
    owns_store: bool = False
    #: Under ``local_mode``: the key a request without one acts with (the admin of
    #: ``local_project``); None otherwise.
    local_key: ApiKey | None = None
    #: Exports each project streams at once (``api_export_project_running``).
    exports: ProjectPlaces = field(default_factory=lambda: ProjectPlaces(
        "export(s)", "TRAJSTORE_API_EXPORT_PROJECT_RUNNING", retry_after_s=5))
    _gateway: Gateway | None = field(default=None, repr=False)
    _derives: DeriveSlots | None = field(default=None, repr=False)

    @classmethod
    def build(cls, settings: Settings, store: EventStore, *, owns_store: bool) -> ApiContext:
        from workers.engines.tokenizers import configure

        configure(cache_size=settings.tokenizer_cache_size)
        local = ApiKey(key_id="local", project=settings.local_project, role="admin",
                       name="local mode", created_at=dt.datetime.now(dt.UTC)) \
            if settings.local_mode else None
        return cls(settings=settings, store=store, keys=KeyStore(store.db, settings),
                   access=Access(store), leasing=Leasing(store), owns_store=owns_store,
                   local_key=local)

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            from api.gateway.service import Gateway

            self._gateway = Gateway(self.settings, self.store, self.access)
        return self._gateway

    @property
    def derives(self) -> DeriveSlots:
        """The budget and the processes of dataset derivations over REST (``api.derive_slots``)."""
        with _DERIVES_LOCK:  # one budget per process, however many requests ask first
            if self._derives is None:
                from api.derive_slots import DeriveSlots, derive_places

                self._derives = DeriveSlots(
                    self.store.db.url, places=derive_places(),
                    per_project=self.settings.api_derive_project_running,
                    processes=self.settings.api_derive_processes)
            return self._derives

    def close(self) -> None:
        self.keys.close()
        if self._derives is not None:
            self._derives.close()
        if self._gateway is not None:
            self._gateway.close()
        if self.owns_store:
            self.store.close()
