"""The running sequences' decode steps, as the scheduler plans and applies them: one read back in the turn that
runs it, or launched ahead (asynchronous scheduling, vLLM's; engine/runner/step_tokens.py): the next step is
launched while the one in flight runs, its input tokens taken on the device from the step in flight's, and
only then is the step in flight read back, so the host's work between two steps (reading tokens, sending
them out, scheduling, launching) no longer leaves the GPU idle. `call_for` and `launch_call` make a step's call;
the scheduler's `update` applies what comes back here (`finish`, `launched`, `collect`): each row's token to
the scheduler's `commit` (a grammar row's through `emit`: sampled here from its masked logits), the step's
tokens out as one message."""
import time
from typing import Callable

from burstserve.engine.core.calls import Decode, DecodeAhead, DecodeResult
from burstserve.engine.core.sampling import row_sampling, step_rules
from burstserve.engine.core.structured_output import mask_logits
from burstserve.engine.scheduler.sequences import RunningSequence, SchedulerState, StepInFlight
from burstserve.engine.scheduler.token_outputs import TokenOutputs


class DecodeSteps:
    def __init__(self, state: SchedulerState, tokens: TokenOutputs, commit: Callable, emit: Callable):
        """commit(seq, token, logprobs, token_computed=...) and emit(seq, logits, sample_logits=...): the
        scheduler's, a token into its sequence."""
        self.state, self.tokens, self.commit, self.emit = state, tokens, commit, emit
        self._collected_at = 0.0                                 # when the last step in flight was read back

    @staticmethod
    def launch_call(batch: list[RunningSequence], fed_from: list[int] | None) -> DecodeAhead:
        """A decode step launched without waiting for its tokens. fed_from: per row, the row of the step in
        flight whose token is its input (not yet on the host, not yet in seq.generated); None: the host's."""
        ahead = int(fed_from is not None)
        tokens = [0 if ahead else s.generated[-1] for s in batch]
        positions = [s.next_input_position() + ahead for s in batch]
        sampling = step_rules([row_sampling(s.request.params, len(s.generated) + ahead) for s in batch])
        return DecodeAhead([s.seq_id for s in batch], tokens, positions, sampling, fed_from=fed_from)

    def launched(self, batch: list[RunningSequence], pending, fed: bool, called: float) -> None:
        """A launched step (its tokens pending on the device; fed: its inputs were the step before's) in flight."""
        self.state.inflight = StepInFlight(batch, pending, fed, called)

    def drain(self) -> StepInFlight | None:
        """The step in flight, if any, taken out of flight to be read back (before anything but another
        decode step): the scheduler's update collects it."""
        prev, self.state.inflight = self.state.inflight, None
        return prev

    def collect(self, step: StepInFlight) -> None:
        """Waits for a launched step's tokens and commits them, as `finish` does. Its rows of sequences that
        ended at the step before (a stop token read back after this step was launched) are dropped; a
        sequence in the step now in flight has that step computing its new token's K/V."""
        tokens, logprobs = step.pending.result()
        now = time.perf_counter()
        self.state.step_seconds = now - (self._collected_at if step.fed else step.launched)
        self._collected_at = now
        fed = {s.seq_id for s in self.state.inflight.batch} if self.state.inflight is not None else set()
        running = {s.seq_id for s in self.state.running}

        def commit_row(i: int, seq: RunningSequence) -> None:
            if seq.seq_id in running:
                self.commit(seq, tokens[i], logprobs[i] if logprobs else None, token_computed=seq.seq_id in fed)
        self._commit_step(step.batch, commit_row)

    @staticmethod
    def call_for(batch: list[RunningSequence]) -> Decode:
        """The batch's decode step: seq ids, last tokens, their positions, sampling rules (None: argmax only),
        the rows sampled on the host."""
        tokens = [s.generated[-1] for s in batch]
        positions = [s.next_input_position() for s in batch]
        host_rows = [i for i, s in enumerate(batch) if s.grammar is not None]   # masked on the host
        sampling = step_rules([s.sampling() for s in batch])
        return Decode([s.seq_id for s in batch], tokens, positions, sampling, host_rows)

    def finish(self, batch: list[RunningSequence], host_rows: list[int], decoded: DecodeResult) -> None:
        """Commits a decode step's tokens (grammar rows sampled here from their masked logits)."""
        sampled, logits, logprobs = decoded.tokens, decoded.host_logits, decoded.logprobs
        masked = {}
        if host_rows:   # a masked copy of those rows, in one call; logprobs still read the model's logits
            rows = mask_logits(logits.clone(), [batch[i].grammar for i in host_rows])
            masked = {i: (logits[j], rows[j]) for j, i in enumerate(host_rows)}

        def commit_row(i: int, seq: RunningSequence) -> None:
            if i in masked:
                self.emit(seq, masked[i][0], sample_logits=masked[i][1])
            else:
                self.commit(seq, sampled[i], logprobs[i] if logprobs else None)
        self._commit_step(batch, commit_row)

    def _commit_step(self, batch: list[RunningSequence], commit_row: Callable) -> None:
        """A step's rows committed in order, commit_row(i, seq), the step's tokens out as one message; the batch
        leaves `running` first (a sequence that runs on is appended back by its commit)."""
        stepped = {s.seq_id for s in batch}
        self.state.running = [s for s in self.state.running if s.seq_id not in stepped]
        with self.tokens.one_message():
            for i, seq in enumerate(batch):
                commit_row(i, seq)
