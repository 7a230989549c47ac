"""Tensor-parallel engine runs for tests/model/test_tensor_parallel.py: the cases, one engine run each
(TP1 in the test's process, TP2 and TP4 in rank processes that share one gloo world of 4), and
prefill-to-decode hand-offs between TP degrees through the shm transport (``handoff``: every
pair of {1, 2, 4}^2; ``pair_main`` on the real model), a colocated worker's ranks. Besides
kvmesh-tiny (4 heads, 2 KV heads), ``uneven_model``: 9 heads and 3 KV heads as SmolLM2-135M has,
so TP2 splits it 2 + 1 GQA groups."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
from typing import Any

PROMPTS = [list(range(60, 100)), [7, 260, 65, 66, 67, 200, 9]]  # 40 tokens (chunked), 7
MAX_TOKENS = 6
NUM_BLOCKS = 16
POOL_BYTES = 4 << 20  # a decode worker's --kv-cache-bytes: 64 of kvmesh-tiny's 64 KiB blocks
WORLD = 4


def tiny_model(quant: str | None) -> Any:
    """kvmesh-tiny in float32, or with every linear layer and the embeddings kept as ``quant``."""
    import torch
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.quant import quantize
    from kvmesh.shared.model.quant_layers import use_quant_weights

    model, _ = load_model("kvmesh-tiny", torch.float32)
    if quant is not None:
        names = [n for n, p in model.named_parameters() if p.dim() == 2]
        weights = {n: quantize(model.get_parameter(n).detach(), quant) for n in names}
        use_quant_weights(model, weights)
    return model


def uneven_model() -> Any:
    """A seeded Llama of SmolLM2-135M's head counts at small dims: 9 query heads and 3 KV heads
    of 32, 2 layers (TP2 holds 2 + 1 KV heads with their query heads)."""
    from kvmesh.shared.model.loader import build_model
    from kvmesh.shared.model.seeded import SeededShape
    from kvmesh.shared.model.tiny import tiny_state_dict

    # hidden 288, 2 layers, 9 heads, 3 KV heads, intermediate 256, 512 positions
    config = SeededShape(288, 2, 9, 3, 256, 512).config()
    weights = tiny_state_dict(config, seed=3)
    return build_model(config, weights.__getitem__, weights, "seeded 9x3")


def run_engine(model: Any, device: str = "cpu", kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Greedy tokens of PROMPTS through one engine on ``device`` (a long prompt prefilled in
    chunks while the short one decodes), and the engine's KV pool afterwards: (blocks, heads
    held, L, 2, bs, D)."""
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    config = EngineConfig(
        block_size=16,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        device=device,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = LLMEngine(model, None, config)
    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens = engine.generate(PROMPTS, params)
    return {
        "tokens": tokens,
        "kv": engine.kv_pool.tensor.clone(),
        "block_bytes": engine.kv_pool.spec.block_bytes,
    }


def decode_pool(model: Any) -> dict[str, Any]:
    """What ``kvmesh serve decode`` (``build_engine``) allocates and builds for its KV pool over
    ``model`` (a rank's share, or the whole model), given POOL_BYTES."""
    import torch
    from kvmesh.services.decode.compose import build_engine
    from kvmesh.services.decode.config import DecodeConfig

    class Allocations:  # the transport's part build_engine uses: memory for the pool
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def allocate(self, nbytes: int) -> torch.Tensor:
            self.sizes.append(nbytes)
            return torch.zeros(nbytes, dtype=torch.uint8)

    memory = Allocations()
    engine = build_engine(DecodeConfig(kv_cache_bytes=POOL_BYTES), model, None, memory)  # type: ignore[arg-type]
    pool = engine.kv_pool
    return {"allocated": memory.sizes, "num_blocks": pool.num_blocks, "nbytes": pool.nbytes}


# the pairs of {1, 2, 4}^2 the hand-offs above leave: a prefill at TP_P (the world's first
# TP_P ranks) to a decode at TP_D (its last TP_D), overlapping where they add up to more than 4
GRID = ((1, 1), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4))


# int8 KV pools on both sides (a scale per 32 values at the end of each head's span)
INT8_HANDOFFS = {"int8_2_to_1": ((0, 1), (2,)), "int8_1_to_2": ((2,), (0, 1))}


def grid_ranks(tp_p: int, tp_d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The world's ranks of a GRID pair's prefill and decode sides."""
    return tuple(range(tp_p)), tuple(range(WORLD - tp_d, WORLD))


def colocated(group: Any) -> list[list[int]] | None:
    """PROMPTS through a colocated worker's ranks at TP ``group``'s size (``kvmesh serve
    colocated --tp N``): each rank builds its engine as the worker's ranks do (``build_engine``
    without a data plane, the whole model's layout, one sampler seed), the leader drives its
    own through ``LeaderEngine`` and each follower replays those calls (``follow``). The
    leader's greedy tokens; None on a follower."""
    import torch.distributed as dist
    from kvmesh.services.decode.compose import build_engine
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.shared.engine.outputs import collect_tokens
    from kvmesh.shared.engine.tp_leader import LeaderEngine, follow
    from kvmesh.shared.engine.tp_ranks import adopt_whole_layout
    from kvmesh.shared.model.tensor_parallel import shard_model
    from kvmesh.shared.text.sampling import SamplingOptions

    tp = dist.get_world_size(group)
    config = DecodeConfig(
        mode="colocated", tp=tp, kv_cache_bytes=POOL_BYTES, max_num_batched_tokens=16
    )
    model = tiny_model(None)
    shard_model(model, group)
    engine = build_engine(config, model, None, None)
    adopt_whole_layout(engine)
    engine.sampler.generator.manual_seed(7)
    if dist.get_rank(group) != 0:
        follow(engine, group)
        return None
    leader = LeaderEngine(engine, group)
    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ids = [f"c{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        leader.add_request(request_id, prompt, params)
    tokens = collect_tokens(leader.step, ids)
    leader.close()
    return tokens


def rank_main(rank: int, port: int, queue: Any) -> None:
    """One rank of the world of 4: TP4 over all (kvmesh-tiny has 2 KV heads: each replicated on
    two ranks), then TP2 in pairs: ranks 0-1 on the float32 model, 2-3 on its Q8_0 twin; then
    the hand-offs (every pair of {1, 2, 4}^2, int8 2 -> 1 and 1 -> 2), a colocated worker's
    ranks at TP4 and TP2, and the uneven model's runs."""
    import torch
    import torch.distributed as dist
    from kvmesh.shared.model.tensor_parallel import shard_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results: dict[str, Any] = {}
        model = tiny_model(None)
        layout = shard_model(model)
        results["tp4"] = run_engine(model) | {"kv_heads": layout.kv_heads}
        results["tp4_decode_pool"] = decode_pool(model)
        quant = None if rank < 2 else "Q8_0"
        model = tiny_model(quant)
        layout = shard_model(model, pairs[rank // 2])
        case = "tp2" if quant is None else "tp2_q8"
        results[case] = run_engine(model) | {"kv_heads": layout.kv_heads}
        results[f"{case}_decode_pool"] = decode_pool(model)
        pair = {(0, 1): pairs[0], (2, 3): pairs[1]}
        results["handoff_2_to_1"] = asyncio.run(handoff(rank, (0, 1), (2,), pair))
        results["handoff_1_to_2"] = asyncio.run(handoff(rank, (2,), (0, 1), pair))
        results["handoff_2_to_2"] = asyncio.run(handoff(rank, (0, 1), (2, 3), pair))
        quad = dist.new_group(list(range(WORLD)))
        groups = pair | {tuple(range(WORLD)): quad}
        for tp_p, tp_d in GRID:
            ranks = grid_ranks(tp_p, tp_d)
            results[f"grid_{tp_p}_to_{tp_d}"] = asyncio.run(handoff(rank, *ranks, groups))
        for name, (prefill, decode) in INT8_HANDOFFS.items():  # head spans with their scales
            results[name] = asyncio.run(handoff(rank, prefill, decode, pair, kv_cache_dtype="int8"))
        results["colocated_tp4"] = colocated(quad)
        results["colocated_tp2"] = colocated(pairs[rank // 2])
        model = uneven_model()  # TP2 in both pairs: 2 + 1 KV heads
        layout = shard_model(model, pairs[rank // 2])
        results["uneven"] = run_engine(model) | {"kv_heads": layout.kv_heads}
        results["uneven_decode_pool"] = decode_pool(model)
        uneven = {"model_fn": uneven_model, "num_kv_heads": 3}
        results["uneven_2_to_1"] = asyncio.run(handoff(rank, (0, 1), (2,), pair, **uneven))
        results["uneven_1_to_2"] = asyncio.run(handoff(rank, (2,), (0, 1), pair, **uneven))
        # pickled here, by value: a tensor put as it is travels as a file descriptor that the
        # test's process may look for only after this process has exited
        queue.put((rank, pickle.dumps(results)))
    finally:
        dist.destroy_process_group()


async def handoff(
    rank: int,
    prefill_ranks: tuple[int, ...],
    decode_ranks: tuple[int, ...],
    groups: dict,
    model_fn: Any = None,
    num_kv_heads: int = 2,
    prompt: list[int] | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any] | None:
    """``prompt`` (default PROMPTS[0]) prefilled at TP len(prefill_ranks), its KV written chunk
    by chunk by every prefill rank straight into the decode rank(s) holding its heads
    (``rank_block_slices`` and ``ChunkPlanner``, the product's planners, over the shm transport),
    then decoded at TP len(decode_ranks). Every rank of the world takes part in the two exchanges
    (the decode ranks' block addresses, the first token). A process may hold a prefill rank and
    a decode rank both, each role with its own engine and transport (two workers on one host).
    A prefill rank returns what it sent; a decode rank its tokens and what it received.
    ``model_fn``: what makes the model (default kvmesh-tiny), of ``num_kv_heads`` KV heads;
    ``groups``: the TP group of each tuple of ranks; ``kv_cache_dtype``: both sides' pools'."""
    import msgspec
    import torch.distributed as dist
    from kvmesh.services.prefill.kv_writes import decode_writers, rank_block_slices
    from kvmesh.services.prefill.plan import ChunkPlanner
    from kvmesh.services.prefill.tp_follower import DecodeTarget, HandOff, PrefillFollower
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.engine.outputs import collect_tokens
    from kvmesh.shared.engine.tp_leader import LeaderEngine
    from kvmesh.shared.kv.head_shards import KVHeadShards
    from kvmesh.shared.model.tensor_parallel import shard_model
    from kvmesh.shared.text.sampling import SamplingOptions
    from kvmesh.shared.transport import (
        Access,
        TransportConfig,
        TransportDescriptor,
        WriteEntry,
        create_transport,
    )

    from support.transport_wire import remote

    async def exchange(value: Any) -> list[Any]:  # off the loop: the transports keep serving
        values: list[Any] = [None] * dist.get_world_size()
        await asyncio.to_thread(dist.all_gather_object, values, value)
        return values

    prompt = PROMPTS[0] if prompt is None else prompt
    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    config = EngineConfig(
        block_size=16,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    make_model = model_fn or (lambda: tiny_model(None))
    src = KVHeadShards(num_kv_heads, len(prefill_ranks))
    dst = KVHeadShards(num_kv_heads, len(decode_ranks))
    result: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:

        async def role(ranks: tuple[int, ...]) -> tuple[Any, Any, Any]:
            """This rank's transport, pool memory and engine of one side."""
            tx = await stack.enter_async_context(create_transport("shm", TransportConfig()))
            model = make_model()
            c = model.config  # the whole model's blocks (float32, 16 tokens): any rank's fits
            memory = tx.allocate(
                NUM_BLOCKS * c.num_key_value_heads * 2 * c.num_hidden_layers * 16 * c.head_dim * 4
            )
            if len(ranks) > 1:
                shard_model(model, groups[ranks])
            return tx, memory, LLMEngine(model, None, config, kv_buffer=memory)

        mine = None
        if rank in decode_ranks:
            dtx, memory, dengine = await role(decode_ranks)
            region = remote(dtx, dtx.register(memory, Access.REMOTE_WRITE))
            block_ids = dengine.reserve_blocks(len(prompt))
            mine = {
                "peer": msgspec.json.encode(dtx.descriptor()),
                "rkey": region.rkey,
                "addrs": [dengine.kv_pool.block_addr(b) for b in block_ids],
                "block_bytes": dengine.kv_pool.spec.block_bytes,
            }
        everyone = await exchange(mine)
        decodes = [everyone[r] for r in decode_ranks]
        first_token = None
        if rank in prefill_ranks[1:]:  # replays the leader's engine calls, writes its heads
            tx, memory, engine = await role(prefill_ranks)
            follower = PrefillFollower(
                engine, groups[prefill_ranks], tx, tx.register(memory), num_kv_heads
            )
            sent = (await follower.run()).num_bytes
            result |= {"sent": sent, "kv_heads_held": engine.kv_pool.spec.num_kv_heads}
        elif rank in prefill_ranks:  # the leader: the prefill worker's part
            tx, memory, engine = await role(prefill_ranks)
            source = tx.register(memory)
            spec = engine.kv_pool.spec
            if len(prefill_ranks) > 1:
                engine = LeaderEngine(engine, groups[prefill_ranks])
            writers = []
            for rank_slice in rank_block_slices(spec, src, dst, 0):
                info = decodes[rank_slice.dst_rank]
                peer = msgspec.json.decode(info["peer"], type=TransportDescriptor)
                endpoint = await stack.enter_async_context(await tx.connect(peer))
                addrs = tuple(info["addrs"])
                planner = ChunkPlanner(
                    len(prompt), 16, spec.block_bytes, addrs, info["block_bytes"], rank_slice
                )
                writers.append((planner, endpoint, info["rkey"]))
            chunks = []
            hand_off = HandOff(
                tuple(
                    DecodeTarget(d["peer"], d["rkey"], tuple(d["addrs"]), d["block_bytes"])
                    for d in decodes
                )
            )
            note = {"note": hand_off} if isinstance(engine, LeaderEngine) else {}
            engine.add_request(
                "r", prompt, params, prefill_only=True, on_chunk=chunks.append, **note
            )
            sent = 0
            while engine.has_unfinished():
                engine.step()
                for chunk in chunks:
                    for planner, endpoint, rkey in writers:
                        w = planner.plan(
                            chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last
                        )
                        entries = [
                            WriteEntry(source, s.local_offset, s.remote_addr, rkey, s.length)
                            for s in w.spans
                        ]
                        await endpoint.write(entries, w.imm)
                        sent += w.num_bytes
                    first_token = chunk.first_token if chunk.is_last else first_token
                chunks.clear()
            if isinstance(engine, LeaderEngine):
                engine.close()
            result |= {"sent": sent, "kv_heads_held": spec.num_kv_heads}
        if rank in decode_ranks:  # a chunk's write from every prefill rank holding its heads
            senders = decode_writers(src, dst, decode_ranks.index(rank))
            num_chunks = -(-len(prompt) // config.max_num_batched_tokens)
            landed = [
                await asyncio.wait_for(dtx.completion_queue.get(), 60)
                for _ in range(num_chunks * len(senders))
            ]
        first_token = (await exchange(first_token))[prefill_ranks[0]]
        if rank in decode_ranks:
            dengine.admit_prefilled("r", prompt, block_ids, first_token, params)
            (tokens,) = collect_tokens(dengine.step, ["r"])
            result |= {
                "tokens": [first_token, *tokens],
                "imms": [c.imm for c in landed],
                "received": sum(c.num_bytes for c in landed),
                "senders": senders,
            }
        return result or None


def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one prompt through one engine over ``model``."""
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=NUM_BLOCKS))
    params = SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    (tokens,) = engine.generate([prompt], params)
    return tokens


def scored(model: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens of ``prompt`` through one engine over ``model``, with each step's two
    likeliest (ids, log-probabilities)."""
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=NUM_BLOCKS))
    params = SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    engine.add_request("greedy", prompt, params)
    tokens: list[int] = []
    steps: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
    while len(tokens) < max_tokens:
        for out in engine.step():
            tokens += out.new_token_ids
            steps += [(lp.top_ids, lp.top_logprobs) for lp in out.logprobs]
    return {"tokens": tokens, "steps": steps}


def teacher(model: Any, ids: list[int]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """``ids`` scored in one prefill (teacher forcing): at each position after the first, the
    two likeliest next tokens (ids, log-probabilities) given those before it."""
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=NUM_BLOCKS))
    params = SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=2)
    engine.add_request("teacher", ids, params)
    while not (outs := [o for o in engine.step() if o.prompt_logprobs is not None]):
        pass
    return [(lp.top_ids, lp.top_logprobs) for lp in outs[0].prompt_logprobs]


# a TP2 pair's hand-offs of the real model, {1, 2}^2 but 1 -> 1 (kvmesh up's own): the prefill
# and decode ranks of the pair's two processes
PAIR_HANDOFFS = {"2_to_1": ((0, 1), (1,)), "1_to_2": ((0,), (0, 1)), "2_to_2": ((0, 1), (0, 1))}


def pair_main(
    rank: int,
    port: int,
    queue: Any,
    path: str,
    prompt: list[int],
    max_tokens: int,
    chat: list[int],
    chat_tokens: int,
) -> None:
    """One rank of a TP2 pair over the model at ``path`` as stored: its greedy tokens and the
    KV heads it holds; ``chat``'s greedy answer (``scored``), and the chat with it scored in one
    prefill (``teacher``); then ``prompt`` handed off between TP1 and TP2 (PAIR_HANDOFFS), what
    this rank sent and received in each."""
    import copy

    import torch
    import torch.distributed as dist
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.tensor_parallel import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        whole, _ = load_model(path)
        model = copy.deepcopy(whole)
        layout = shard_model(model)
        tokens = greedy(model, prompt, max_tokens)
        result = {"tokens": tokens, "kv_heads": layout.kv_heads, "q": layout.q_heads}
        result["chat"] = answer = scored(model, chat, chat_tokens)
        answer["teacher"] = teacher(model, chat + answer["tokens"])
        groups = {(0, 1): dist.new_group([0, 1])}
        heads = whole.config.num_key_value_heads
        for name, (prefill, decode) in PAIR_HANDOFFS.items():
            result[name] = asyncio.run(
                handoff(rank, prefill, decode, groups, lambda: copy.deepcopy(whole), heads, prompt)
            )
        queue.put((rank, result))  # plain values: no tensors
    finally:
        dist.destroy_process_group()
