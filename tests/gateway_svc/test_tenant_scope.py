"""API keys are tenants for the caches that learn from outputs: the key check records the
request's tenant, and its cache scope is always inside that tenant's namespace."""

from __future__ import annotations

import asyncio

from gateway_svc.auth import ApiKeyCheck, tenant_of, tenant_scope


def _call(check: ApiKeyCheck, key: bytes | None) -> tuple[dict | None, list]:
    seen: dict = {}
    sent: list = []

    async def app(scope, receive, send):
        seen["scope"] = scope

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", b"Bearer " + key)] if key is not None else []
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(ApiKeyCheck(app, check.keys and [k.decode() for k in check.keys])(scope, None, send))
    return seen.get("scope"), sent


def test_each_api_key_gets_its_own_tenant_and_a_client_cannot_name_another_tenants_scope():
    check = ApiKeyCheck(lambda *a: None, ["sk-alice", "sk-bob"])
    alice, _ = _call(check, b"sk-alice")
    bob, _ = _call(check, b"sk-bob")
    assert alice["state"]["tenant"] == tenant_of(b"sk-alice") != bob["state"]["tenant"]
    # Bob naming Alice's full scope still lands inside Bob's namespace.
    alices = tenant_scope(alice["state"]["tenant"], "chat")
    assert tenant_scope(bob["state"]["tenant"], alices) != alices
    assert tenant_scope(bob["state"]["tenant"], alices).startswith(bob["state"]["tenant"] + "/")


def test_a_refused_key_reaches_no_route_and_no_keys_leave_the_clients_scope_alone():
    check = ApiKeyCheck(lambda *a: None, ["sk-alice"])
    reached, sent = _call(check, b"sk-mallory")
    assert reached is None and sent[0]["status"] == 401
    assert tenant_scope(None, "chat") == "chat"
