"""The cluster's buyers: fresh customers on the locked endpoint, every answer kept.

Like ``loadtests/locustfile.py``'s ``LockedBuyer`` (one unit, a new customer each
time, no wait), through the load balancer (``--host http://nginx:8000``), and each
answer is appended to ``CLUSTER_ANSWERS`` as JSON lines
``{"t": monotonic, "c": customer, "s": status, "ms": latency}`` (status 0: a
client timeout or connection error, whose outcome the client cannot know). The
checks compare these answers with the orders in PostgreSQL.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid

from locust import HttpUser, task

PRODUCT_ID = os.environ.get("SHOP_PRODUCT_ID", "1")
TIMEOUT = float(os.environ.get("CLUSTER_CLIENT_TIMEOUT", "20"))
_answers = open(os.environ.get("CLUSTER_ANSWERS", os.devnull), "a", encoding="utf-8")  # noqa: SIM115
_lock = threading.Lock()
_counter = itertools.count()
_prefix = uuid.uuid4().hex[:8]


class ClusterBuyer(HttpUser):
    """A new customer each purchase, one unit, on ``POST buy/``."""

    @task
    def buy(self) -> None:
        customer = f"c-{_prefix}-{next(_counter)}"
        started = time.monotonic()
        with self.client.post(
            f"/shop/products/{PRODUCT_ID}/buy/",
            json={"customer": customer, "quantity": 1},
            name="buy/",
            timeout=TIMEOUT,
            catch_response=True,
        ) as response:
            status = int(response.status_code or 0)
            if status in (201, 409, 423, 503):
                response.success()
            else:
                response.failure(f"HTTP {status}")
        now = time.monotonic()
        line = json.dumps(
            {"t": now, "c": customer, "s": status, "ms": round((now - started) * 1e3)}
        )
        with _lock:
            _answers.write(line + "\n")
            _answers.flush()
