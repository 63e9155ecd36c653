"""The engine: one daemon thread looping schedule -> run -> sample -> stops/detokenize -> publish.

Thread model: `submit`, `abort`, `stats` and `shutdown` may be called from any thread; they only
touch an inbox guarded by one condition variable. Everything else (scheduler, pages, sequences,
runner) belongs to the engine thread, which sleeps on the condition when there is no work. Sinks
are called from the engine thread, outside the lock, and must not block for long (the server
hands events over to its event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from tokenizers import Tokenizer

from helios.engine.api import (
    EngineStats,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    PromptLogprob,
    Sink,
    TokenLogprob,
)
from helios.engine.assembly import (
    RunnerChoice,
    build_runner,
    host_store_arguments,
    kv_page_bytes,
    page_copier,
    speculator_for,
    state_snapshot_arguments,
)
from helios.engine.block_manager import BlockManager
from helios.engine.constraints import ConstraintError, Constraints, RowMask
from helios.engine.host_store import HostStoreConfig
from helios.engine.prefix_cache import PrefixCache, PrefixCacheConfig
from helios.engine.runner import PromptScores, StepOutput, StepRow
from helios.engine.sampler import explicit_logprob, prompt_logprob_entries, sample_outputs, token_logprob
from helios.engine.scheduler import Batch, Scheduler, step_rows
from helios.engine.sequence import Sequence
from helios.engine.speculation import RoundCounts, SpeculationConfig
from helios.engine.step_io import StepRunner
from helios.engine.validation import RequestCheck
from helios.engine.vision import ImagePlacer
from helios.manifest import Manifest

log = logging.getLogger("helios.engine")

QUEUE_DEADLINE_MESSAGE = "no model slot became free before the queue deadline; retry shortly"
PREFILL_SAMPLE_TOKENS = 64  # smaller prefill steps are dominated by fixed per-step costs


class Engine:
    def __init__(
        self,
        core_dir: Path,
        manifest: Manifest,
        *,
        max_concurrency: int | None = None,
        kv_pages: int | None = None,
        threads: int | None = None,
        runner: StepRunner | None = None,
        tokenizer: Tokenizer | None = None,
        prefix_cache: PrefixCacheConfig | None = None,
        host_store: HostStoreConfig | None = None,
        speculation: SpeculationConfig | None = None,
        choice: RunnerChoice | None = None,
    ):
        """choice: which step engine runs the core, where (default: the ONNX graph on the CPU);
        ignored when `runner` is given."""
        self.core_dir = Path(core_dir)
        self.manifest = manifest
        limits = manifest.limits
        if runner is None:
            runner = build_runner(
                self.core_dir,
                manifest,
                choice or RunnerChoice(),
                kv_pages or limits.kv_pages,
                threads,
                max_concurrency or limits.max_concurrency,
            )
        elif kv_pages is not None and kv_pages != runner.num_pages:
            raise ValueError(f"kv_pages={kv_pages} but the given runner has {runner.num_pages} pages")
        if not isinstance(runner, StepRunner):
            raise TypeError(f"{type(runner).__name__} does not implement StepRunner (helios/engine/step_io.py)")
        self.runner = runner
        if tokenizer is None:
            tokenizer = Tokenizer.from_file(str(self.core_dir / manifest.tokenizer.file))
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(runner.num_pages, manifest.kv.page_tokens)
        speculator = speculator_for(self.core_dir, manifest, runner, speculation)
        self.prefix_cache = PrefixCache(
            self.block_manager,
            copy_page=page_copier(runner, speculator),
            page_bytes=kv_page_bytes(manifest, runner.pool_dtype),
            config=prefix_cache,
            **state_snapshot_arguments(manifest, runner),
            **host_store_arguments(manifest, runner, host_store),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_concurrency=max_concurrency or limits.max_concurrency,
            max_batch_tokens=limits.max_batch_tokens,
            prefill_chunk_size=limits.prefill_chunk_size,
            prefix_cache=self.prefix_cache,
            state_slots=runner.num_state_slots,
            speculator=speculator,
            window=manifest.kv.window if manifest.drafter is None else None,  # a drafter reads every page
        )
        self.context_length = limits.context_length
        self.vocab_size = manifest.architecture.vocab_size
        self.check = RequestCheck.for_core(manifest, runner.can_score_prompts)
        self.eos_token_ids = list(manifest.tokenizer.eos_token_ids)
        self.constraints = Constraints(tokenizer, self.vocab_size, self.eos_token_ids)
        self.images = ImagePlacer.for_core(self.core_dir, manifest, threads)  # a text-only core's does nothing

        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []  # guarded by _cv
        self._aborts: list[tuple[str, str | None]] = []  # (request id, server's reason); guarded by _cv
        self._live: set[str] = set()  # request ids submitted and not yet finished; guarded by _cv
        self._next_arrival = 0  # guarded by _cv
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._seqs: dict[str, Sequence] = {}  # engine thread only

        self._prefill_tokens = 0
        self._generated_tokens = 0
        self._completed = self._cancelled = self._failed = 0  # requests by how they ended
        self._steps = 0
        self._rounds = RoundCounts()  # speculative rounds (api.md)
        self._step_seconds = 0.0
        self._schedule_seconds = 0.0

    # -- public, thread-safe -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="helios-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step; unfinished requests end with ERROR."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine thread did not stop within %.0f s", timeout)
                return
        self._fail_all("engine shut down")
        if self.prefix_cache.host is not None:
            self.prefix_cache.host.close()  # pending disk writes finish

    def healthy(self) -> bool:
        """The step loop is alive and accepting work."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; events go to `sink` (from the engine thread). Raises ValueError."""
        self.check(request)
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already active")
            seq = Sequence.create(
                request, self._next_arrival, self.tokenizer, self.eos_token_ids, self.context_length, sink
            )
            self.constraints.attach(seq)
            self.images.mark(seq)
            self._next_arrival += 1
            self._live.add(request.request_id)
            self._inbox.append(seq)
            self._cv.notify()

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """Cancel a request at the next step boundary (final event: ABORT, with `reason` as its
        error when the server rather than the client cancels). False if not live."""
        with self._cv:
            if request_id not in self._live:
                return False
            self._aborts.append((request_id, reason))
            self._cv.notify()
            return True

    def abort_all(self, reason: str) -> int:
        """Cancel every live request (a drain deadline passed); returns how many."""
        with self._cv:
            live = sorted(self._live)
            self._aborts.extend((rid, reason) for rid in live)
            self._cv.notify()
        return len(live)

    def num_pending(self) -> int:
        """Requests submitted but not running (new or preempted): what admission bounds."""
        with self._cv:
            inbox = len(self._inbox)
        return inbox + len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        sched = self.scheduler
        cache = self.prefix_cache
        spec = sched.speculator
        learned = spec.learned if spec is not None else None
        return EngineStats(
            active=len(sched.running),
            pending=self.num_pending(),
            free_pages=self.block_manager.num_free,
            total_pages=self.block_manager.num_pages,
            page_tokens=self.block_manager.page_tokens,
            kv_pool_bytes=self.runner.pool_bytes,
            kv_pool_dtype=self.runner.pool_dtype,
            prefill_tokens_total=self._prefill_tokens,
            generated_tokens_total=self._generated_tokens,
            completed_total=self._completed,
            cancelled_total=self._cancelled,
            failed_total=self._failed,
            steps_total=self._steps,
            admitted_total=sched.num_admissions,
            preempted_total=sched.num_preemptions,
            step_seconds_total=self._step_seconds,
            schedule_seconds_total=self._schedule_seconds,
            reused_tokens_total=cache.reused_tokens,
            cache_hits_total=cache.hits,
            cached_pages=cache.cached_pages,
            checkpoint_storage_pages=cache.storage_pages if cache.enabled else 0,
            intake_pages=cache.intake_pages,
            checkpoints=cache.num_checkpoints,
            checkpoint_captures=cache.capture_counts(),
            checkpoint_skips=dict(cache.skips),
            checkpoint_evictions_total=cache.evictions,
            checkpoint_extra_work_ns_total=cache.extra_work_ns,
            reasoning_budget_cuts_total=self.constraints.budget_cuts,
            grammar_mask_seconds_total=self.constraints.mask_seconds,
            graph_seconds_total=self.runner.graph_seconds,
            decode_graph_launches_total=self.runner.decode_graph_launches,
            replay_gpu_ns_total=self.runner.replay_gpu_ns,
            host_store=cache.host.stats() if cache.host is not None else None,
            verification_rounds_total=self._rounds.rounds,
            verification_drafts_total=self._rounds.offered,
            accepted_drafts_total=self._rounds.accepted,
            draft_rounds_total=self._rounds.draft_rounds,
            rounds_by_width=dict(self._rounds.by_width),
            history_drafts_enabled=spec is not None and spec.config.history_drafts,
            draft_steps_total=learned.steps if learned is not None else 0,
            learned_drafter=learned is not None,
            images=self.images.counters(),
        )

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> list[GenerationEvent]:
        """Blocking convenience: submit and collect every event. Without a started thread the
        caller's thread drives the steps (handy in tests and scripts)."""
        events: list[GenerationEvent] = []
        done = threading.Event()

        def sink(event: GenerationEvent) -> None:
            events.append(event)
            if event.finished:
                done.set()

        self.submit(request, sink)
        if self._thread is None:
            while not done.is_set():
                self.step()
        elif not done.wait(timeout):
            self.abort(request.request_id)
            raise TimeoutError(f"request {request.request_id!r} did not finish in {timeout} s")
        return events

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work()):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                progressed = self.step()
            except Exception:  # a bug outside any request's step: keep serving
                log.exception("engine step failed")
                progressed = False
            if not progressed:
                # Work exists but nothing could move (should not happen): back off, don't spin.
                with self._cv:
                    self._cv.wait(0.01)

    def step(self) -> bool:
        """Run one engine step on the calling thread. Returns whether anything happened.

        Only the engine thread calls this once `start()` has been called.
        """
        t0 = time.perf_counter()
        emitted: list[tuple[Sequence, GenerationEvent]] = []
        changed = self._drain_inbox(emitted)

        try:
            batch = self.scheduler.schedule()
        except Exception as exc:  # scheduler bug: fail everything rather than loop on it
            log.exception("scheduling failed")
            for seq in list(self._seqs.values()):
                emitted.append((seq, self._fail(seq, f"scheduling failed: {exc}")))
            self._publish(emitted)
            return True
        t1 = time.perf_counter()
        self._schedule_seconds += t1 - t0

        for seq in batch.finished:  # no room left in the pool: LENGTH
            emitted.append((seq, self._final_event(seq, [], seq.stop_checker.finish_text(), None)))
        if batch.rows:
            self._run_batch(batch, emitted)
            self._steps += 1
        self._step_seconds += time.perf_counter() - t0
        self._publish(emitted)
        return changed or bool(batch.rows or batch.finished)

    def _drain_inbox(self, emitted: list[tuple[Sequence, GenerationEvent]]) -> bool:
        with self._cv:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for seq in inbox:
            self._seqs[seq.request_id] = seq
            self.scheduler.add(seq)
        for rid, reason in aborts:
            seq = self._seqs.get(rid)
            if seq is None:
                continue  # finished in the meantime
            emitted.append((seq, self._end(seq, FinishReason.ABORT, reason)))
        expired = self._expired_waits()
        for seq in expired:
            emitted.append((seq, self._end(seq, FinishReason.ABORT, QUEUE_DEADLINE_MESSAGE)))
        return bool(inbox or aborts or expired)

    def _expired_waits(self) -> list[Sequence]:
        """Waiting sequences never admitted whose queue deadline has passed (a preempted one
        already produced output, so it keeps its place)."""
        now = time.monotonic()
        return [
            seq
            for seq in self.scheduler.waiting
            if seq.num_preemptions == 0 and seq.request.queue_deadline is not None and seq.request.queue_deadline <= now
        ]

    def _run_batch(self, batch: Batch, emitted: list[tuple[Sequence, GenerationEvent]]) -> None:
        """One step of a scheduled batch: its runner inputs, the forward pass, then sampling and
        the tokens' bookkeeping."""
        if self.scheduler.speculator is not None and self.scheduler.speculator.learned is not None:
            self.scheduler.speculator.learned.draft(batch.rows)  # learned drafts, before the target verifies
        rows = step_rows(batch)
        self.images.place(rows, [r.seq for r in batch.rows])
        sampling = [i for i, r in enumerate(batch.rows) if r.samples]
        # Grammar masks and forced tokens of the rows that sample, computed beside the forward pass.
        masking = self.constraints.begin([batch.rows[i].seq for i in sampling])
        out = self._run(batch, rows, emitted)
        if out is not None:
            self._postprocess(batch, out, sampling, masking.result() if masking is not None else {}, emitted)

    def _run(
        self, batch: Batch, rows: list[StepRow], emitted: list[tuple[Sequence, GenerationEvent]]
    ) -> StepOutput | None:
        """The forward pass and what it commits in the scheduler's books; None: it failed, and
        every row's request with it."""
        started = time.perf_counter()
        try:
            out = self.runner.step(rows)
        except Exception as exc:
            log.exception("runner step failed for %d rows", len(rows))
            for r in batch.rows:
                if not r.seq.is_finished:
                    emitted.append((r.seq, self._fail(r.seq, f"runner step failed: {exc}")))
            return None
        self.scheduler.commit(batch)
        # Every completed step graph is a verification graph (api.md counts its rounds and width).
        self._rounds.step([len(r.drafts) for r in batch.rows], [len(r.drafts) for r in batch.rows if r.is_decode])
        prefilled = sum(r.num_tokens for r in batch.rows if not r.is_decode)
        self._prefill_tokens += prefilled
        if self.prefix_cache.host is not None and prefilled >= PREFILL_SAMPLE_TOKENS:
            # The host store prices a restore against the prefill it replaces: this step's rate.
            self.prefix_cache.host.observe_prefill(prefilled, time.perf_counter() - started)
        return out

    def _postprocess(
        self,
        batch: Batch,
        out: StepOutput,
        sampling: list[int],
        masks: dict[int, RowMask],
        emitted: list[tuple[Sequence, GenerationEvent]],
    ) -> None:
        """Prompt scores, then a token for each row that samples (`sampling`: their indices in
        the batch; `masks`: by position in `sampling`), then the speculative rounds."""
        if out.prompt_scores is not None:
            for r, scores in zip(batch.rows, out.prompt_scores):
                if scores is not None:
                    emitted.append((r.seq, self._prompt_event(r.seq, scores)))
        todo: list[tuple[int, Sequence, RowMask | None]] = []  # (batch row, sequence, its mask)
        for j, i in enumerate(sampling):
            seq, mask = batch.rows[i].seq, masks.get(j)
            if seq.sampling.max_tokens == 0:  # scoring only: ends once its prompt is computed
                self.scheduler.finish(seq, FinishReason.LENGTH)
                emitted.append((seq, self._final_event(seq, [], "", None)))
            elif seq.is_finished:
                continue
            elif mask is not None and mask.error is not None:
                emitted.append((seq, self._fail(seq, mask.error)))
            else:
                todo.append((i, seq, mask))
        if not todo:
            return
        seqs = [seq for _, seq, _ in todo]
        row_masks = [mask for _, _, mask in todo] if masks else None
        try:
            tokens = sample_outputs(out, seqs, row_masks, [out.index(i) for i, _, _ in todo])
        except Exception as exc:
            log.exception("sampling failed")
            for seq in seqs:
                emitted.append((seq, self._fail(seq, f"sampling failed: {exc}")))
            return
        for (i, seq, mask), token in zip(todo, tokens.tolist()):
            if token < 0:
                log.error("non-finite logits for %s", seq.request_id)
                emitted.append((seq, self._fail(seq, "the model produced non-finite logits")))
                continue
            forced = mask is not None and mask.forced is not None
            self._commit_safely(seq, token, out, out.index(i), forced, emitted)
        self._verify(batch, out, emitted)

    def _commit_safely(
        self,
        seq: Sequence,
        token: int,
        out: StepOutput,
        at: int,
        forced: bool,
        emitted: list[tuple[Sequence, GenerationEvent]],
    ) -> None:
        try:
            emitted.append((seq, self._commit_token(seq, token, out, at, forced)))
        except ConstraintError as exc:
            emitted.append((seq, self._fail(seq, str(exc))))
        except Exception as exc:  # e.g. a detokenizer failure: only this request fails
            log.exception("postprocessing failed for %s", seq.request_id)
            emitted.append((seq, self._fail(seq, f"postprocessing failed: {exc}")))

    def _verify(self, batch: Batch, out: StepOutput, emitted: list[tuple[Sequence, GenerationEvent]]) -> None:
        """Speculative rounds (helios.engine.speculation): while the token a row committed at a
        position equals its draft there, that draft's K/V stands and the next position's output
        gives the next token; the first mismatch's token (or the bonus) ends the round."""
        drafted = [(i, r) for i, r in enumerate(batch.rows) if r.drafts]
        # A committed token equal to the draft at its position accepts it (even if it ended the request).
        accepted = {i: int(r.seq.token_ids[-1] == r.drafts[0]) for i, r in drafted}
        active = [(i, r) for i, r in drafted if accepted[i] and not r.seq.is_finished]
        position = 1
        while active:
            for _, r in active:  # draft `position` is committed: its K/V is the sequence's now
                r.seq.num_computed_tokens += 1
            seqs = [r.seq for _, r in active]
            at = [out.index(i, position) for i, _ in active]
            try:
                tokens = sample_outputs(out, seqs, None, at)
            except Exception as exc:
                log.exception("sampling failed")
                emitted.extend((seq, self._fail(seq, f"sampling failed: {exc}")) for seq in seqs)
                break
            following = []
            for (i, r), o, token in zip(active, at, tokens.tolist()):
                if token < 0:
                    emitted.append((r.seq, self._fail(r.seq, "the model produced non-finite logits")))
                    continue
                self._commit_safely(r.seq, token, out, o, False, emitted)
                if position < len(r.drafts) and token == r.drafts[position] and r.seq.token_ids[-1] == token:
                    accepted[i] += 1
                    if not r.seq.is_finished:
                        following.append((i, r))
            active, position = following, position + 1
        speculator = self.scheduler.speculator
        for i, r in drafted:
            self._rounds.accepted += accepted[i]
            if speculator is not None:
                speculator.record(r.seq, len(r.drafts), accepted[i])

    def _commit_token(
        self, seq: Sequence, token: int, out: StepOutput, i: int, forced: bool = False
    ) -> GenerationEvent:
        self.constraints.commit(seq, token, forced)
        seq.append_token(token)
        self._generated_tokens += 1
        outcome = seq.stop_checker.on_token(token, seq.num_generated)
        k = seq.sampling.logprobs
        logprobs: list[TokenLogprob] | None = None
        if k is not None:
            entry = None
            if outcome.has_logprob_entry and not forced:  # forced tokens have no entry (api.md)
                explicit = seq.sampling.logprob_token_ids
                if explicit:
                    assert out.token_logprobs is not None
                    entry = explicit_logprob(
                        token, out.logits[i], out.logsumexp[i], explicit, out.token_logprobs[i, : len(explicit)]
                    )
                else:
                    entry = token_logprob(
                        token, out.logits[i], out.logsumexp[i], out.top_logprobs[i], out.top_ids[i], k
                    )
            # Entries of tokens a partial stop sequence holds wait for their text.
            logprobs = seq.stop_checker.entries(outcome, entry)
        if outcome.finished:
            self.scheduler.finish(seq, outcome.finish_reason, outcome.stop_reason)
            return self._final_event(seq, [token], outcome.text, logprobs)
        return self._event(seq, [token], outcome.text, logprobs)

    def _prompt_event(self, seq: Sequence, scores: PromptScores) -> GenerationEvent:
        """The prompt entries this step completed (position 0's null entry comes first)."""
        entries: list[PromptLogprob | None] = [None] if seq.prompt_scored == 0 else []
        first, n = max(seq.prompt_scored, 1), len(scores.target_logprobs)
        entries += [
            None if e.token_id < 0 else e  # an image token's position has no entry (api.md)
            for e in prompt_logprob_entries(scores, seq.token_ids[first : first + n], seq.request.prompt_logprobs or 0)
        ]
        seq.prompt_scored = first + n
        event = self._event(seq, [], "", None)
        event.prompt_logprobs = entries
        return event

    # -- events and bookkeeping ----------------------------------------------------------------

    def _event(
        self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None
    ) -> GenerationEvent:
        if logprobs is None and seq.sampling.logprobs is not None:
            logprobs = []  # requested: always a list, empty when this event has no entries
        return GenerationEvent(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens,
            completion_tokens=seq.num_generated,
        )

    def _final_event(
        self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None
    ) -> GenerationEvent:
        """The request's last event; also retires it from the engine's books."""
        event = self._event(seq, token_ids, text, logprobs)
        event.finished = True
        event.finish_reason = seq.finish_reason
        event.stop_reason = seq.stop_reason
        if seq.finish_reason is FinishReason.ABORT:
            self._cancelled += 1
        elif seq.finish_reason is FinishReason.ERROR:
            self._failed += 1
        else:
            self._completed += 1
            if self.scheduler.speculator is not None:
                self.scheduler.speculator.remember(seq)
        self._seqs.pop(seq.request_id, None)
        with self._cv:
            self._live.discard(seq.request_id)
        return event

    def _fail(self, seq: Sequence, message: str) -> GenerationEvent:
        return self._end(seq, FinishReason.ERROR, message)

    def _end(self, seq: Sequence, reason: FinishReason, message: str | None) -> GenerationEvent:
        """Retire `seq` with `reason` (ERROR, or ABORT by client or server); `message` says why."""
        self.scheduler.finish(seq, reason)
        event = self._final_event(seq, [], "", None)
        event.error = message
        return event

    def _fail_all(self, message: str) -> None:
        emitted = []
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            self._seqs[seq.request_id] = seq
        for seq in list(self._seqs.values()):
            emitted.append((seq, self._fail(seq, message)))
        self._publish(emitted)

    def _publish(self, emitted: list[tuple[Sequence, GenerationEvent]]) -> None:
        for seq, event in emitted:
            if seq.sink is None:
                continue
            try:
                seq.sink(event)
            except Exception:
                # A broken consumer must not take the engine down; stop working for it.
                log.exception("event sink failed for %s; aborting it", seq.request_id)
                if not event.finished:
                    self.abort(seq.request_id)
