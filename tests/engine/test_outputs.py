"""A Request crosses to worker 0 pickled with its prompt packed as int32 (engine/core/outputs.py) and arrives
with the same ids as a list, whichever form it was given in."""
import array
import pickle
import random

from burstserve.engine.core.outputs import PROMPT_TYPECODE, Request
from burstserve.engine.core.sampling import SamplingParams


def test_a_request_arrives_with_its_prompt_as_the_same_list():
    ids = [random.randrange(200_000) for _ in range(random.randrange(1, 5000))]
    params = SamplingParams(temperature=0.5, max_tokens=7, seed=random.randrange(1 << 20))
    for given in (ids, array.array(PROMPT_TYPECODE, ids)):
        request = Request("r-1", given, params, 123.5, return_logits=True)
        arrived = pickle.loads(pickle.dumps(request))
        assert type(arrived.prompt_token_ids) is list and arrived.prompt_token_ids == ids
        assert (arrived.request_id, arrived.params, arrived.arrival_time, arrived.return_logits) == \
            ("r-1", params, 123.5, True)
        assert request.prompt_token_ids is given                  # the sender's copy is untouched
