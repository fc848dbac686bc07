"""Role decisions among several routers in a Kubernetes cluster: whoever holds the coordination.k8s.io
Lease decides. Against a fake API server that does what the real one does with a Lease (create once,
update only at the current resourceVersion, 409 otherwise)."""
import asyncio
import datetime

import aiohttp
from aiohttp import web

from services.router.leadership import KubernetesLease

PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases"


class FakeApi:
    def __init__(self) -> None:
        self.lease: dict | None = None
        self.version = 0
        self.tokens: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(PATH + "/{name}", self.get)
        app.router.add_post(PATH, self.create)
        app.router.add_put(PATH + "/{name}", self.update)
        return app

    async def get(self, request):
        self.tokens.append(request.headers.get("Authorization", ""))
        return web.json_response(self.lease) if self.lease else web.json_response({}, status=404)

    async def create(self, request):
        if self.lease is not None:
            return web.json_response({}, status=409)
        return self._store(await request.json())

    async def update(self, request):
        body = await request.json()
        if body["metadata"].get("resourceVersion") != str(self.version):
            return web.json_response({}, status=409)
        return self._store(body)

    def _store(self, body):
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return web.json_response(self.lease, status=200)


def test_one_router_holds_the_lease_until_it_stops_renewing(tmp_path):
    token = tmp_path / "token"
    token.write_text("sa-token\n")

    async def main():
        api = FakeApi()
        runner = web.AppRunner(api.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        leases = [KubernetesLease("roles", 15, identity=name, api=f"http://127.0.0.1:{port}", token_path=token,
                                  namespace="ns", ca_path=tmp_path / "none") for name in ("a", "b")]
        steps = []
        try:
            async with aiohttp.ClientSession() as session:
                steps.append([await lease.try_hold(session) for lease in leases])
                steps.append([lease.is_leader() for lease in leases])
                stale = {"metadata": dict(api.lease["metadata"])}
                past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=20)
                api.lease["spec"]["renewTime"] = past.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # "a" stopped renewing
                steps.append([await leases[1].try_hold(session)])
                steps.append([api.lease["spec"]["holderIdentity"], await leases[0].try_hold(session),
                              leases[0].is_leader(), leases[1].is_leader()])
                async with session.put(f"http://127.0.0.1:{port}{PATH}/roles", json=stale) as reply:
                    steps.append([reply.status])  # an update at an old resourceVersion loses
        finally:
            await runner.cleanup()
        return steps, set(api.tokens)
    steps, tokens = asyncio.run(main())
    assert steps == [[True, False], [True, False], [True], ["b", False, False, True], [409]]
    assert tokens == {"Bearer sa-token"}
