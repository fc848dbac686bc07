"""Which router makes role decisions when several run in front of the same workers: at most one at a
time, with no consensus of our own. Under `prfaas up` (no orchestrator) it is replica 0, fixed; in a
Kubernetes cluster it is whoever holds a coordination.k8s.io Lease, whose resourceVersion the API
server compares on every update (its optimistic concurrency is the only arbiter).

``KubernetesLease`` talks to the API server from inside a pod (its service account's token and CA);
``lease_decision`` is its pure core."""
from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Leadership(Protocol):
    def is_leader(self) -> bool:
        """Whether this router may make role decisions now. Never blocks."""


@dataclass(frozen=True, slots=True)
class Fixed:
    leader: bool

    def is_leader(self) -> bool:
        return self.leader


always_leader = Fixed(True)


def lease_decision(spec: dict, me: str, now: datetime.datetime) -> bool:
    """Whether ``me`` may write itself as the holder of a Lease whose spec is ``spec``: it holds it
    already, nobody does, or the holder has not renewed it for its lease duration."""
    holder = spec.get("holderIdentity") or ""
    if holder in ("", me):
        return True
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    expires = _parse_time(renewed) + datetime.timedelta(seconds=int(spec.get("leaseDurationSeconds") or 0))
    return now >= expires


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubernetesLease:
    """Holds (or waits for) the Lease ``name`` in the pod's namespace; ``start`` runs its renewal loop.
    Leader while its last successful write is younger than the lease duration."""

    def __init__(self, name: str, duration_s: float, identity: str | None = None,
                 api: str | None = None, token_path: Path = SERVICE_ACCOUNT / "token",
                 namespace: str | None = None, ca_path: Path = SERVICE_ACCOUNT / "ca.crt") -> None:
        self.name = name
        self.duration_s = duration_s
        self.identity = identity or os.environ.get("HOSTNAME") or "router"
        self._api = api or _api_from_env()
        self._token_path = token_path
        self._namespace = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        self._ca_path = ca_path
        self._held_until = 0.0
        self._task: asyncio.Task | None = None

    def is_leader(self) -> bool:
        return asyncio.get_running_loop().time() < self._held_until

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        context = ssl.create_default_context(cafile=str(self._ca_path)) if self._ca_path.exists() else None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            while True:
                try:
                    await self.try_hold(session)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    logger.warning("lease %s: %s", self.name, exc)
                await asyncio.sleep(self.duration_s / 3)

    async def try_hold(self, session: aiohttp.ClientSession) -> bool:
        """One round: read the Lease, write this router as its holder where ``lease_decision`` allows;
        a write that lost a race (409) or was refused leaves it unheld here."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        url = f"{self._api}/apis/coordination.k8s.io/v1/namespaces/{self._namespace}/leases"
        headers = {"Authorization": f"Bearer {self._token_path.read_text().strip()}"}
        timeout = aiohttp.ClientTimeout(total=self.duration_s / 3)
        now = datetime.datetime.now(datetime.timezone.utc)
        async with session.get(f"{url}/{self.name}", headers=headers, timeout=timeout) as reply:
            existing = await reply.json() if reply.status == 200 else None
            if reply.status not in (200, 404):
                raise ValueError(f"reading the Lease: HTTP {reply.status}")
        spec = (existing or {}).get("spec", {})
        if not lease_decision(spec, self.identity, now):
            self._held_until = 0.0
            return False
        holder_changes = spec.get("holderIdentity") != self.identity
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {**(existing or {}).get("metadata", {}), "name": self.name},
                "spec": {**spec, "holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration_s),
                         "renewTime": _format_time(now),
                         **({"acquireTime": _format_time(now)} if holder_changes else {})}}
        if existing is None:
            request = session.post(url, json=body, headers=headers, timeout=timeout)
        else:
            request = session.put(f"{url}/{self.name}", json=body, headers=headers, timeout=timeout)
        async with request as reply:
            if reply.status not in (200, 201):
                self._held_until = 0.0
                logger.info("lease %s: not taken (HTTP %d)", self.name, reply.status)
                return False
        if holder_changes:
            logger.info("lease %s: held by %s; this router makes role decisions", self.name, self.identity)
        self._held_until = started + self.duration_s
        return True


def _api_from_env() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("router.role_decisions is kubernetes-lease, but this router runs outside a Kubernetes pod "
                         "(KUBERNETES_SERVICE_HOST is unset)")
    return f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
