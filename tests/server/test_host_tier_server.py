"""The KV host tier seen from the API (--kv-offload-gb): a question about a document that later documents
evicted from the GPU pool reports the document as cached_tokens, and /metrics counts the host hit, the
bytes copied, the restore's time and the tier's usage; the periodic stats line shows the tier."""
import dataclasses
import random
from types import SimpleNamespace

import pytest

from burstserve.clients.server_process import RemoteServer
from burstserve.engine.core.messages import EngineFigures
from hf_reference import save_checkpoint, save_tokenizer
from live import metrics
from burstserve.server.stats_log import stats_line

KEY = "host-tier-key"
DOC = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("host-tier"))
    save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))
    save_tokenizer(path)
    srv = RemoteServer(["--model", path, "--served-model-name", "m", "--devices", "cpu", "-cp", "2", "--dtype", "float32",
                        "--max-model-len", "512", "--kv-cache-tokens", "256", "--kv-offload-gb", "0.01"], api_key=KEY)
    yield srv
    srv.stop()


def _complete(server, prompt: list[int]) -> int:
    """The prompt's cached_tokens (3 greedy tokens asked)."""
    r = server.client().completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    return r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0


def test_a_question_about_an_evicted_document_is_answered_from_host_memory(server):
    docs = [[random.randrange(2, 320) for _ in range(DOC)] for _ in range(5)]
    for doc in docs:
        _complete(server, doc)
    before = metrics(server)
    cached = _complete(server, docs[0] + [random.randrange(2, 320) for _ in range(9)])
    after = metrics(server)
    assert cached in (DOC, DOC + 1)        # one more where the question's first token is the document's answer
    hits = after["burstserve:prefix_cache_host_hits_total{}"] - before.get("burstserve:prefix_cache_host_hits_total{}", 0)
    assert hits == cached
    assert after["burstserve:kv_offload_restored_bytes_total{}"] > before["burstserve:kv_offload_restored_bytes_total{}"]
    assert after["burstserve:kv_offload_stored_bytes_total{}"] > 0
    assert after["burstserve:kv_offload_restore_seconds_count{}"] >= 1
    assert after["burstserve:kv_host_cache_capacity_tokens{}"] > 5 * DOC
    usage = [v for k, v in after.items() if k.startswith("burstserve:kv_host_cache_usage_perc")]
    assert len(usage) == 2 and all(0 < u < 1 for u in usage), usage


def test_the_stats_line_shows_the_host_tier():
    stats = EngineFigures(running=1, kv_capacity_per_worker=100, kv_tokens_per_worker=[10, 20],
                          kv_host_capacity_per_worker=1000, kv_host_tokens_per_worker=[250, 500],
                          prefix_cache_host_hits=300)
    engine = SimpleNamespace(llm=SimpleNamespace(stats=stats), waiting=0)
    line = stats_line(engine, 1.0, 2.0)
    assert "KV host tier per worker [25.0%, 50.0%], 300 tokens restored" in line, line
    engine.llm.stats = dataclasses.replace(stats, kv_host_capacity_per_worker=0)
    assert "host" not in stats_line(engine, 1.0, 2.0)
