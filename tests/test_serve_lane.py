"""The engine's lanes in process: a lane's batch and cache follow its busy requests, each batch size
runs its own plan, and no move between sizes changes a token or compiles after start-up."""

import concurrent.futures

import pytest
from reference import drafting_chat_model as chat_model

import s3d_jax
from s3d_jax import decoding, planning
from s3d_jax.options import DecodeOptions
from s3d_jax.serve import lane as lane_module
from s3d_jax.serve.engine import Engine
from s3d_jax.serve.lane import Lane
from s3d_jax.serve.request import Request

pytestmark = pytest.mark.needs("bundled_model")  # its tokenizer
QUESTIONS = [f"Question {i}: what is {i} plus {i}?" for i in range(7)]


def test_a_lane_s_cache_grows_and_shrinks_with_its_requests_and_outputs_stay_exact(monkeypatch):
    """A short request, a long one beside it, then a short one alone: the loop runs with the cache that
    the longest request in it needs, each reply is plain greedy decoding's for that prompt alone, and
    nothing compiles after start-up."""
    monkeypatch.setattr(lane_module, "MIN_CAPACITY", 128)  # sizes 128 and 256
    original, sizes = Lane.resize, []

    def record(self, capacity):
        if capacity != self.capacity:
            sizes.append(capacity)
        original(self, capacity)

    monkeypatch.setattr(Lane, "resize", record)
    model = chat_model()
    engine = Engine(model, slots=2, max_len=256).start()
    compiled = (decoding.compile_count(), len(engine.executables))

    def ask(question, new_tokens) -> concurrent.futures.Future:
        done = concurrent.futures.Future()
        tokens = []

        def deliver(delta):
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                done.set_result((tokens, delta.finish_reason))

        engine.submit(Request(model.tokenizer.encode(question), new_tokens, deliver))
        return done

    try:
        short, long = ask(QUESTIONS[0], 6), ask(QUESTIONS[1], 150)
        asked = [(QUESTIONS[0], 6, short.result(300)), (QUESTIONS[1], 150, long.result(300))]
        asked.append((QUESTIONS[2], 6, ask(QUESTIONS[2], 6).result(300)))
    finally:
        engine.stop()
    assert sizes == [256, 128]  # grown for the long request beside the short one, shrunk once it left
    assert (decoding.compile_count(), len(engine.executables)) == compiled
    for question, new_tokens, (tokens, finish) in asked:
        alone = s3d_jax.decode(model, model.tokenizer.encode(question), method="ar", max_new_tokens=new_tokens)
        assert tokens == alone.tokens and finish == "length", question


def test_the_loop_runs_at_the_busy_rows_and_moving_rows_changes_no_token(monkeypatch):
    """Three requests at once grow the batch from 1 to 2 to 3 rows; once the two short ones finish, the
    long one, in the last row, moves to a batch of one. Every reply is greedy decoding's for that prompt
    alone, and nothing compiles after start-up."""
    monkeypatch.setattr(lane_module, "MIN_CAPACITY", 128)  # one cache size: only the batch changes
    original, batches = Lane.regroup, []

    def record(self, rows):
        if rows != len(self.requests):
            batches.append(rows)
        original(self, rows)

    monkeypatch.setattr(Lane, "regroup", record)
    model = chat_model()
    engine = Engine(model, slots=3, max_len=128)
    engine.start()
    compiled = (decoding.compile_count(), len(engine.executables))
    asked = [(QUESTIONS[0], 4), (QUESTIONS[1], 4), (QUESTIONS[2], 40)]
    replies = [concurrent.futures.Future() for _ in asked]

    def deliver_to(reply, tokens):
        def deliver(delta):
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                reply.set_result(tokens)
        return deliver

    # All three waiting before the engine's thread admits any.
    engine.submit(*(Request(model.tokenizer.encode(question), new_tokens, deliver_to(reply, []))
                    for (question, new_tokens), reply in zip(asked, replies)))
    try:
        got = [reply.result(300) for reply in replies]
    finally:
        engine.stop()
    assert batches == [2, 3, 1], batches
    assert (decoding.compile_count(), len(engine.executables)) == compiled
    for (question, new_tokens), tokens in zip(asked, got):
        assert tokens == s3d_jax.decode(model, model.tokenizer.encode(question), method="ar", max_new_tokens=new_tokens).tokens


def test_each_batch_size_runs_its_own_plan_and_a_request_moves_between_them_exactly(monkeypatch):
    """A drafting policy per occupancy: a lane whose batch of one drafts a tree and whose batches of two
    and three take plain steps. A long request starts alone (drafting), a short one joins (plain steps
    for both), and the long one returns to a batch of one only after SHRINK_AFTER chunks that it fits.
    Its reply is greedy decoding's alone, and its counts hold both kinds of iteration."""
    monkeypatch.setattr(lane_module, "MIN_CAPACITY", 128)
    model = chat_model()
    drafting = planning.plan_for(model.config, DecodeOptions(method="s3d", min_certainty=0.0, tree=4))
    plain = planning.plan_for(model.config, DecodeOptions(method="ar"))
    lane = Lane(model, {1: drafting, 2: plain, 3: plain}, 3, 128, (), {})
    batches, finished, finished_at = [], {}, {}

    def admit(request):
        slot = lane.free_slot()
        lane.insert(request, lane.prefill(request), slot)

    def chunk():
        tokens, generated, done, counts = lane.advance(2)
        batches.append((len(lane.requests), lane.plan.method))
        for slot in lane.active:
            if done[slot]:
                request = lane.requests[slot]
                request.bank(*counts[slot])
                finished[id(request)] = tokens[slot, len(request.prompt_ids) : len(request.prompt_ids) + generated[slot]].tolist()
                finished_at[id(request)] = len(batches) - 1
                lane.free(slot)

    long, short = (Request(model.tokenizer.encode(q), n, lambda delta: None) for q, n in ((QUESTIONS[3], 36), (QUESTIONS[4], 3)))
    admit(long)
    chunk()
    admit(short)
    while id(long) not in finished:
        chunk()
    kinds = [b for i, b in enumerate(batches) if i == 0 or b != batches[i - 1]]
    assert kinds == [(1, "s3d"), (2, "ar"), (1, "s3d")], batches
    shrunk_at = batches.index((1, "s3d"), 1)
    assert shrunk_at - finished_at[id(short)] == lane_module.SHRINK_AFTER, batches  # not the chunk after the short one left
    assert finished[id(long)] == s3d_jax.decode(model, long.prompt_ids, method="ar", max_new_tokens=36, eos_token_ids=()).tokens
    assert long.accepted.sum() > 0 and long.plain_steps > 0
