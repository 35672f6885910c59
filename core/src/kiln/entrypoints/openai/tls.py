"""TLS for ``kiln serve``: checking the ``--ssl-*`` flags, and reloading changed certificates."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import threading
from collections.abc import Callable

logger = logging.getLogger("kiln.server")


def check_tls_args(args: argparse.Namespace) -> None:
    """Refuse ``--ssl-*`` combinations uvicorn would accept but not honour, before the model loads."""
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile: needs --ssl-certfile")
    tls_only = {
        "--ssl-ca-certs": args.ssl_ca_certs,
        "--ssl-cert-reqs": args.ssl_cert_reqs != ssl.CERT_NONE,
        "--enable-ssl-refresh": args.enable_ssl_refresh,
    }
    for flag, given in tls_only.items():
        if given and not args.ssl_certfile:
            raise ValueError(f"{flag}: needs TLS (--ssl-certfile)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs: client certificates are verified against --ssl-ca-certs; give it")
    for flag, path in (
        ("--ssl-certfile", args.ssl_certfile),
        ("--ssl-keyfile", args.ssl_keyfile),
        ("--ssl-ca-certs", args.ssl_ca_certs),
    ):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path}")


class CertRefresher:
    """Polls the key, certificate and CA files (``--enable-ssl-refresh``) and loads them into the
    server's live ``SSLContext`` when one changes: new connections get the new certificate, open
    ones keep theirs. A half-written file is retried at the next poll, the old one stays in use.

    The reload runs on ``event_loop()`` (the loop that does the handshakes) when there is one:
    loading a certificate and then its key are two steps, and no handshake may fall between them.
    CA certificates are added to those trusted; dropping one takes a restart."""

    def __init__(
        self,
        context: ssl.SSLContext,
        certfile: str,
        keyfile: str | None,
        ca_certs: str | None,
        event_loop: Callable[[], asyncio.AbstractEventLoop | None] = lambda: None,
        interval: float = 1.0,
    ) -> None:
        self.context, self.certfile, self.keyfile, self.ca_certs = context, certfile, keyfile, ca_certs
        self.event_loop = event_loop
        self.interval = interval
        self._seen = self._stamps()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kiln-ssl-refresh", daemon=True)
        self.reloads = 0

    def start(self) -> CertRefresher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _stamps(self) -> dict[str, float | None]:
        stamps = {}
        for path in (self.certfile, self.keyfile, self.ca_certs):
            if path:
                try:
                    stamps[path] = os.stat(path).st_mtime_ns
                except OSError:
                    stamps[path] = None
        return stamps

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            stamps = self._stamps()
            if stamps == self._seen:
                continue
            try:
                loop = self.event_loop()
                if loop is None:
                    self._reload()
                else:
                    asyncio.run_coroutine_threadsafe(self._reload_on_loop(), loop).result()
            except (OSError, ssl.SSLError) as exc:
                logger.warning("TLS files changed but do not load yet (%s); keeping the old ones", exc)
                continue
            self._seen = stamps
            self.reloads += 1
            logger.info("reloaded the TLS certificate files")

    def _reload(self) -> None:
        self.context.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs:
            self.context.load_verify_locations(self.ca_certs)

    async def _reload_on_loop(self) -> None:
        self._reload()
