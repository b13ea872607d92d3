"""Residency in the fleet: replicas labelled by region and pool (`mci serve --region --pool`,
reported at /server_info), and `mci router --tenants` sending each tenant's requests only to
the replicas its regions and pools allow (narrowed by X-Mci-Region), failing closed (503)
when none is available; the same rule at the Ray Serve ingress. Every check counts requests
(each replica's own /metrics, the router's counter), none times them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from server_helpers import LiveServer

from mci.ray_serve.residency import refusal
from mci.tenancy.residency import Labels, allowed, narrowing_error
from mci.tenancy.tenants import Tenant, TenantTable

TENANTS = {
    "tenants": {
        "acme": {"api_keys": ["sk-acme"], "regions": ["eu"]},
        "beta": {"api_keys": ["sk-beta"]},
        "gold": {"api_keys": ["sk-gold"], "pools": ["dedicated"]},
    }
}
EU, US = Labels("eu"), Labels("us")


# ---- the rule ---------------------------------------------------------------------------------
def test_the_rule_pins_regions_and_pools_and_the_header_only_narrows():
    acme = Tenant("acme", regions=("eu",))
    beta = Tenant("beta")
    gold = Tenant("gold", regions=("eu", "us"), pools=("dedicated",))
    assert allowed(acme, None, EU) is None and allowed(acme, None, US) == "region"
    assert allowed(acme, None, Labels()) == "region"  # unlabelled: outside every region
    assert allowed(beta, None, US) is None and allowed(beta, None, Labels()) is None
    assert allowed(beta, "us", US) is None and allowed(beta, "us", EU) == "region"
    assert allowed(beta, "us", Labels()) == "region"
    assert allowed(acme, "eu", EU) is None
    assert allowed(gold, None, Labels("eu", "dedicated")) is None
    assert allowed(gold, None, Labels("eu", "shared")) == "pool"
    assert allowed(gold, None, Labels("eu")) == "pool"
    assert allowed(gold, None, Labels("ap", "dedicated")) == "region"
    assert narrowing_error(acme, "eu") is None and narrowing_error(beta, "us") is None
    assert "'us' is not allowed for tenant 'acme'" in narrowing_error(acme, "us")
    assert Labels.from_info({"region": "eu", "pool": None, "model": "m"}) == EU
    assert Labels.from_info({"region": 3}) == Labels() == Labels.from_info("not json")


def test_the_ray_ingress_check_fails_closed_for_a_deployment_outside_the_tenant():
    table = TenantTable.from_dict(TENANTS)

    def answer(key, labels, region=None):
        headers = {"authorization": f"Bearer {key}"}
        if region is not None:
            headers["x-mci-region"] = region
        response = refusal(table, headers, labels)
        return None if response is None else (response.status_code, json.loads(response.body))

    assert answer("sk-acme", EU) is None and answer("sk-beta", US) is None
    status, body = answer("sk-acme", US)
    assert status == 503 and "region eu (tenant 'acme')" in body["error"]["message"]
    assert "this deployment: region us" in body["error"]["message"]
    status, body = answer("sk-gold", US)
    assert status == 503 and "pool dedicated" in body["error"]["message"]
    assert answer("sk-nope", EU)[0] == 401
    assert answer("sk-nope", EU)[1]["error"]["code"] == "invalid_api_key"
    assert answer("sk-acme", EU, region="us")[0] == 403
    assert answer("sk-beta", US, region="eu")[0] == 503  # the header narrows, fails closed
    assert refusal(TenantTable.single(None), {}, Labels()) is None  # no tenants: as before


def test_health_checks_read_labels_and_keep_a_failed_half_open_worker_out():
    """With a mock fleet: labels come from /server_info at passing checks (a replica that does
    not say has none, and stays healthy); a breaker-ejected worker whose check fails stays out
    after its cooldown, until a check passes."""
    import asyncio

    from mci.router.app import Router
    from mci.router.config import RouterConfig

    replies = {"/health": 200, "/server_info": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        status = replies[request.url.path]
        if status is None:
            raise httpx.ConnectError("down", request=request)
        return httpx.Response(status, json={"region": "eu", "pool": "p", "model": "m"})

    async def scenario():
        router = Router(RouterConfig(breaker_cooldown=0.0), ["http://a"])
        await router.client.aclose()
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        worker = router.pool.workers["http://a"]
        await router.check_health()
        assert worker.labels == Labels("eu", "p") and worker.available
        replies["/server_info"] = 500  # says nothing: no labels, still healthy
        await router.check_health()
        assert worker.labels == Labels() and worker.available
        for _ in range(3):  # the breaker opens; its cooldown (0 s) ends at once
            router.pool.failed(worker)
        replies["/health"] = None
        await router.check_health()
        assert not worker.available  # the failed check keeps it out past the cooldown
        replies["/health"], replies["/server_info"] = 200, 200
        await router.check_health()
        assert worker.available and worker.labels == Labels("eu", "p")
        assert (worker.ejections, worker.readmissions) == (1, 1)
        await router.client.aclose()

    asyncio.run(scenario())


# ---- the fleet --------------------------------------------------------------------------------
def _served(replica: LiveServer) -> float:
    """Requests the replica itself finished (its mci:request_success_total, all reasons)."""
    return replica.metric("mci:request_success_total{")


def _rejections(router: LiveServer, reason: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    name = f'mci_router:residency_rejections_total{{reason="{reason}"}} '
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _client(router: LiveServer, key: str, region: str | None = None):
    import openai

    headers = {"X-Mci-Region": region} if region else None
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key=key, max_retries=0, default_headers=headers
    )


def _complete(client, i: int = 0) -> str:
    return client.completions.create(model="m", prompt=f"x = {i}", max_tokens=2).choices[0].text


def _until(condition, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _available(router: LiveServer, url: str) -> bool:
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return next(w for w in workers if w["url"] == url)["available"]


def test_tenants_stay_in_their_region_and_fail_closed(checkpoint, tmp_path):
    import openai

    path = checkpoint()
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps(TENANTS))
    one_thread = {"OMP_NUM_THREADS": "1"}  # two replicas and a router on a 2-core machine
    labelled = ("--served-model-name", "m", "--region")
    eu = LiveServer(path, *labelled, "eu", env=one_thread)
    us = LiveServer(path, *labelled, "us", env=one_thread)
    flags = ("--worker-urls", eu.url, us.url, "--tenants", str(tenants), "--policy", "round_robin")
    router = LiveServer(None, *flags, "--health-check-interval", "0.2", command="router")
    try:
        acme, beta = _client(router, "sk-acme"), _client(router, "sk-beta")
        workers = httpx.get(router.url + "/workers").json()["workers"]
        assert [(w["region"], w["pool"]) for w in workers] == [("eu", None), ("us", None)]
        assert httpx.get(eu.url + "/server_info").json() == {
            "hicache_store": None,
            "region": "eu",
            "pool": None,
            "model": "m",
            "disaggregation_mode": "null",
            "disaggregation_bootstrap": None,
        }

        # acme (pinned to eu): every request on eu; us rejected once per routing decision
        for i in range(6):
            _complete(acme, i)
        assert (_served(eu), _served(us)) == (6, 0)
        assert _rejections(router, "region") == 6
        # beta (unrestricted): round robin over both
        for i in range(6):
            _complete(beta, i)
        assert (_served(eu), _served(us)) == (9, 3)

        # an unknown key: 401, the key never echoed
        with pytest.raises(openai.AuthenticationError) as info:
            _complete(_client(router, "sk-wrong"))
        assert info.value.body["code"] == "invalid_api_key"
        assert "sk-wrong" not in json.dumps(info.value.body)

        # X-Mci-Region narrows (beta to us, acme to eu) and cannot widen (acme to us: 403)
        for i in range(4):
            _complete(_client(router, "sk-beta", "us"), i)
        for i in range(2):
            _complete(_client(router, "sk-acme", "eu"), i)
        assert (_served(eu), _served(us)) == (11, 7)
        with pytest.raises(openai.PermissionDeniedError) as info:
            _complete(_client(router, "sk-acme", "us"))
        assert "not allowed for tenant 'acme'" in info.value.body["message"]
        assert _rejections(router, "region") == 6 + 4 + 2
        # gold's dedicated pool has no replica: 503, both replicas rejected for their pool
        with pytest.raises(openai.InternalServerError) as info:
            _complete(_client(router, "sk-gold"))
        assert info.value.status_code == 503 and "pool dedicated" in info.value.body["message"]
        assert _rejections(router, "pool") == 2 and _served(us) == 7

        # eu SIGKILLed under acme's stream: the stream is not resumed on us, it fails
        started, events = threading.Semaphore(0), []

        def stream():
            body = {"prompt": "x", "max_tokens": 1900, "ignore_eos": True, "stream": True}
            headers = {"authorization": "Bearer sk-acme"}
            with httpx.stream(
                "POST", router.url + "/v1/completions", json=body, headers=headers, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            started.release()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.acquire(timeout=60), "the stream sent nothing"
        os.kill(eu.proc.pid, signal.SIGKILL)
        reader.join(60)
        assert "could not resume" in events[-1]["error"]["message"]
        # us rejected twice: for the stream's first hop and for its resume
        assert _rejections(router, "region") == 14 and _served(us) == 7
        eu.stop()

        # no eu replica: acme fails closed, us untouched; beta still served (on us)
        _until(lambda: not _available(router, eu.url), what="eu never left the pool")
        for i in range(3):
            with pytest.raises(openai.InternalServerError) as info:
                _complete(acme, i)
            assert info.value.status_code == 503
            assert "region eu (tenant 'acme')" in info.value.body["message"]
            assert "not sent to replicas outside it" in info.value.body["message"]
        assert _rejections(router, "region") == 17 and _served(us) == 7
        for i in range(2):
            _complete(beta, i)
        assert _served(us) == 9

        # eu back on its port: acme served again once a health check has seen it
        eu = LiveServer(path, *labelled, "eu", port=eu.port, env=one_thread)
        _until(lambda: _available(router, eu.url), what="eu was not re-admitted")
        _complete(acme)
        assert (_served(eu), _served(us)) == (1, 9)

        # SIGHUP reloads the tenants file; a broken one keeps the table in force
        tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["sk-acme-2"]}}}))
        os.kill(router.proc.pid, signal.SIGHUP)
        _until(lambda: _models(router, "sk-acme-2") == 200, what="the new file was not read")
        assert _models(router, "sk-acme") == 401
        tenants.write_text('{"tenants": {"acme": {"api_keys": ["sk-secret-in-a-broken-file"')
        os.kill(router.proc.pid, signal.SIGHUP)
        time.sleep(0.5)
        assert _models(router, "sk-acme-2") == 200
        assert router.stop() == 0
        log = router.log.text(ended=True)
        assert "tenants file reloaded: 1 tenant(s)" in log
        assert "tenants file not reloaded, keeping the previous one" in log
        assert not any(key in log for key in ("sk-acme", "sk-beta", "sk-gold", "sk-secret"))
    finally:
        for server in (router, us, eu):
            server.stop()


def _models(router: LiveServer, key: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.get(router.url + "/v1/models", headers=headers, timeout=10).status_code
