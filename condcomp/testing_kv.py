"""The KV-policy contract, as one call on your own policy: ``check_kv_policy`` (re-exported by
:mod:`condcomp.testing`).

>>> from condcomp.testing import check_kv_policy  # doctest: +SKIP
>>> check_kv_policy("window", {"sinks": 1, "window": 3}, rule=lambda p, j: j < 1 or p - j < 3)  # doctest: +SKIP

A broken policy fails with an ``AssertionError`` that names the policy, the check and what to do. It runs on a tiny
random Llama (2 layers, 8 query heads over 4 key/value groups, nothing downloaded; needs ``transformers``), with
half of each request's groups kept in full and the policy holding the others, on 3 prompts of 6, 4 and 2 real
tokens (left padding):

- **decode equals one prefill**: the prompt, then ``new_tokens`` greedy tokens one call at a time through a
  ``DynamicCache``, give the logits of one forward over the whole sequence. With ``rule`` (``rule(p, j)``: may a
  query at real-token position ``p`` read the key at position ``j <= p``, in a group the policy holds), that forward
  is the per-head reference executor without a cache, masked by the rule built entry by entry: it shares no code
  with the policy. Without ``rule`` it is one cached prefill of the whole sequence through the policy itself (with
  the prompt's plan): what decoding carries from call to call must give what the policy computes in one call.
- **bytes counted by hand**: ``tensors(state)`` lists every tensor found in the state object (its fields,
  tuples, dicts); each is a whole tensor, not a view into a larger storage (a view keeps the whole storage alive:
  copy the rows kept); ``cache_bytes`` of every layer equals the kept groups' keys and values plus those tensors'
  bytes.
- **rows**: ``batch_select_indices`` (rows 2 and 0) and ``reorder_cache`` (beam search: rows 1, 1, 0) carry the
  state (``take_rows``); the next token's logits equal the reference's on those rows.
- **keys_read**: an int in ``[0, S]``, at the prefill and for the next token.
- **crop**: ``cache.crop(-1)`` then the same token again gives the same logits. A policy that cannot crop raises a
  ``ValueError`` saying so (it is reported as a warning, not a failure).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.kv import KV_FULL, KV_WINDOW, RequestPlan
from condcomp.registry import KV_POLICIES, registered_name
from condcomp.types import AttentionInputs

Rule = Callable[[int, int], bool]  # (query position, key position) -> may attend, in a group the policy holds
PROMPT, TOL = 6, 1e-4


def require(condition: object, message: str) -> None:
    """An ``AssertionError`` with ``message`` unless ``condition`` holds (``python -O`` strips asserts)."""
    if not condition:
        raise AssertionError(message)


def check_kv_policy(policy: Any, options: dict[str, Any] | None = None, rule: Rule | None = None,
                    new_tokens: int = 4) -> None:
    """Run the KV-policy contract on ``policy`` (a registered name, or the class ``register_kv_policy``
    registered) built with ``options``; see the module docstring for what is checked."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("check_kv_policy runs a tiny Llama of transformers: pip install 'condcomp[hf]'") from err
    name = registered_name(policy, KV_POLICIES)
    what = f"KV policy {name!r}"
    try:
        built = KV_POLICIES.get(name)(**(options or {}))
    except Exception as err:  # noqa: BLE001 - reported with the policy's name
        raise AssertionError(f"{what}: building it with options {options or {}} failed: {err!r}") from err
    require(isinstance(built, condcomp.KVPolicy), f"{what}: {type(built).__name__} is not a condcomp.KVPolicy "
             "subclass: derive from it (it brings take_rows, crop, tensors and keys_read defaults)")
    model = _tiny_llama(transformers)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=(name, dict(options or {})))
    condcomp.apply_(model, cfg)
    model.eval()
    ids, mask = _prompts()
    tokens, full, logits, cache = _run("decode", what, lambda: generate_by_hand(model, ids, mask, new_tokens))
    plans = condcomp.request_plans(model, cache)
    modes = {m for p in plans.values() for row in p.group_modes() for m in row}
    require(built.stores != "own" or name in modes, f"{what}: no group is held by it ({sorted(modes)}): the "
             "check would be vacuous")
    reference = "the rule's reference (one forward without a cache)" if rule else "one prefill of the sequence"

    def want(toks: Tensor, msk: Tensor, rows_plans: dict[str, RequestPlan]) -> Tensor:  # (B, S, V)
        if rule is not None:
            return rule_logits(model, rows_plans, toks, msk, rule)
        return _run("one prefill", what, lambda: _prefill_logits(transformers, model, toks, msk))

    ref = want(tokens, full, plans)
    for i, got in enumerate(logits):
        _close(got, ref[:, PROMPT - 1 + i], f"{what}: {'the prefill' if i == 0 else f'decode step {i}'} through the "
               f"cache differs from {reference}", "what attend computes (the rule over state + this call's keys) "
               "or what it keeps in the state between calls")
    if built.stores == "own":
        _check_bytes(model, cache, built, what)
    for label, move, rows in (("batch_select_indices", "batch_select_indices", [2, 0]),
                              ("reorder_cache (beam search)", "reorder_cache", [1, 1, 0])):
        moved = copy.deepcopy(cache)
        index = torch.tensor(rows)
        _run(label, what, partial(getattr(moved, move), index))
        toks, msk = _extend(tokens[index], full[index], logits[-1][index].argmax(-1, keepdim=True))
        got = _run(f"the step after {label}", what, partial(_step, model, toks, msk, moved, 1))
        _close(got, want(toks, msk, condcomp.request_plans(model, moved))[:, -1],
               f"{what}: the next token after {label} (rows {rows}) differs from {reference}",
               "take_rows must return the state of exactly those rows, in that order (repeats included)")
    _check_crop(model, cache, tokens, full, logits[-1], what)


def _check_bytes(model: nn.Module, cache: Any, policy: Any, what: str) -> None:
    from condcomp.integrations.hf.cache import cache_bytes

    plans = list(condcomp.request_plans(model, cache).values())
    counted = cache_bytes(cache)
    for n, (layer, plan, got) in enumerate(zip(cache.layers, plans, counted, strict=True)):
        assert plan.kv_modes is not None
        B = int(plan.kv_modes.shape[0])
        S = int(layer.get_seq_length())
        config: Any = model.config
        Dh = int(config.hidden_size) // int(config.num_attention_heads)
        g = int((plan.kv_modes == KV_FULL).sum(-1).max())  # kept groups, compacted to the widest row's count
        state = getattr(layer, "condcomp_windows", None)
        held = [] if state is None else _reachable(state)  # every tensor the state object holds, found here
        listed = [] if state is None else list(policy.tensors(state))
        for x in listed:
            require(isinstance(x, Tensor), f"{what}: tensors(state) lists a {type(x).__name__}: list every tensor "
                     "the state holds, and only tensors")
        missing = [tuple(x.shape) for x in held if all(x is not y for y in listed)]
        require(not missing, f"{what}: layer {n}: tensors(state) leaves out the state's tensors of shapes {missing}: "
                 "cache_bytes counts only what it lists, so the cache's bytes would be undercounted")
        for x in held:
            whole = x.untyped_storage().nbytes()
            require(whole == x.numel() * x.element_size(), f"{what}: layer {n}: a state tensor of shape "
                     f"{tuple(x.shape)} is a view of a {whole}-byte storage ({x.numel() * x.element_size()} bytes "
                     "its own): the cache keeps the whole storage alive. Keep a copy of the rows kept (.clone(), "
                     "or condcomp.kv.window.take_entries), so memory is freed")
        for before, T, width in ((None, PROMPT, PROMPT), (state, 1, S + 1)):  # its prefill, then one more token
            read = policy.keys_read(before, T, width)
            require(isinstance(read, int) and not isinstance(read, bool) and 0 <= read <= width,
                     f"{what}: keys_read(state, T={T}, S={width}) returned {read!r}: the most keys one of its heads "
                     f"reads in the call, an int in [0, {width}]")
        by_hand = 4 * 2 * B * g * S * Dh + sum(x.numel() * x.element_size() for x in held)
        require(got == by_hand, f"{what}: layer {n}: cache_bytes counts {got} bytes, the kept groups' keys and "
                 f"values plus the state's tensors hold {by_hand}: tensors(state) must list every tensor the state "
                 "holds, each once")
    require(any(getattr(layer, "condcomp_windows", None) is not None for layer in cache.layers),
             f"{what}: stores 'own' but no layer of the cache holds a state: attend must return the new state when "
             "keep is true")


def _reachable(state: Any) -> list[Tensor]:
    """Every tensor held by ``state`` (through dataclass fields, tuples, lists, dicts and attributes), once each."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if id(x) in seen or depth > 8:
            return
        seen.add(id(x))
        if isinstance(x, Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)
        elif hasattr(x, "__dict__") or hasattr(x, "__slots__"):
            names = list(getattr(x, "__dict__", {})) + list(getattr(type(x), "__slots__", ()))
            for name in names:
                walk(getattr(x, name, None), depth + 1)

    walk(state, 0)
    return found


def _check_crop(model: nn.Module, cache: Any, tokens: Tensor, mask: Tensor, last: Tensor, what: str) -> None:
    cropped = copy.deepcopy(cache)
    try:
        cropped.crop(-1)
    except (ValueError, NotImplementedError) as err:
        require(str(err).strip(), f"{what}: crop raised {type(err).__name__} with no message: say why it cannot "
                 "crop and what to do")
        warnings.warn(f"{what}: crop is refused ({err}); assisted decoding cannot use it", stacklevel=3)
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"{what}: cache.crop(-1) failed: {err!r}. crop(state, tokens) returns the state without "
                             "each request's last tokens, or raises a ValueError saying why it cannot") from err
    got = _run("the step after crop", what, lambda: _step(model, tokens, mask, cropped, 1))
    _close(got, last, f"{what}: after cache.crop(-1), the same token again gives other logits than before",
           "crop(state, tokens) must forget exactly each request's last tokens (positions and counts included)")


# ---- the model, the loop and the references ---------------------------------------------------------------------

def _tiny_llama(transformers: Any) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=4, vocab_size=97,
                                          max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        return transformers.LlamaForCausalLM(config).eval()  # type: ignore[no-any-return]


def _prompts() -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` (3, 6): rows of 6, 4 and 2 real tokens, left-padded."""
    ids = torch.randint(1, 97, (3, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, PROMPT, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids, mask


def _positions(mask: Tensor) -> Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _extend(tokens: Tensor, mask: Tensor, nxt: Tensor) -> tuple[Tensor, Tensor]:
    return torch.cat([tokens, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)


@torch.no_grad()
def _step(model: nn.Module, tokens: Tensor, mask: Tensor, cache: Any, new: int) -> Tensor:
    out = model(input_ids=tokens[:, -new:], attention_mask=mask, position_ids=_positions(mask)[:, -new:],
                cache=cache, use_cache=True)
    return out.logits[:, -1]  # type: ignore[no-any-return]


@torch.no_grad()
def generate_by_hand(model: nn.Module, ids: Tensor, mask: Tensor, new: int) -> tuple[Any, ...]:
    """Greedy decoding by hand on a ``DynamicCache``: the prefill, then ``new`` one-token calls; returns
    ``(tokens, mask, each call's last logits, cache)``."""
    import transformers

    cache = transformers.DynamicCache()
    logits = [_step(model, ids, mask, cache, ids.shape[1])]
    tokens = ids
    for _ in range(new):
        tokens, mask = _extend(tokens, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(_step(model, tokens, mask, cache, 1))
    return tokens, mask, logits, cache


@torch.no_grad()
def _prefill_logits(transformers: Any, model: nn.Module, tokens: Tensor, mask: Tensor) -> Tensor:
    """Every position's logits from one cached call over the whole sequence, the plan decided from the prompt."""
    with condcomp.plan_from_prompt(model, PROMPT):
        out = model(input_ids=tokens, attention_mask=mask, position_ids=_positions(mask),
                    cache=transformers.DynamicCache(), use_cache=True)
    return out.logits  # type: ignore[no-any-return]


def rule_bias(mask: Tensor, plan: RequestPlan, rule: Rule) -> Tensor:
    """``(B, H, S, S)`` float64: 0 where a query may read a key, -inf elsewhere. Kept groups: causal over real
    tokens; groups the policy holds: also ``rule(p, j)``; groups at the ``full`` policy: causal."""
    B, S = mask.shape
    H, Hkv = plan.heads.shape[1], plan.kv_groups.shape[1]
    assert plan.kv_modes is not None
    pos = (mask.long().cumsum(-1) - 1).tolist()
    bias = torch.full((B, H, S, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            by_policy = int(plan.kv_modes[b, h // (H // Hkv)]) == KV_WINDOW
            for i in range(S):
                for j in range(i + 1):
                    if mask[b, i] and mask[b, j] and (not by_policy or rule(pos[b][i], pos[b][j])):
                        bias[b, h, i, j] = 0.0
    return bias


@torch.no_grad()
def rule_logits(model: nn.Module, plans: dict[str, RequestPlan], tokens: Tensor, mask: Tensor, rule: Rule
                 ) -> Tensor:
    """One forward without a cache in which every wrapped layer is the per-head reference loop on the request's
    plan, masked by ``rule`` for the groups the policy holds."""
    ref = copy.deepcopy(model)
    for name, routed in condcomp.api.routed_modules(ref).items():
        plan = plans[name]
        bias = rule_bias(mask.bool(), plan, rule).float()

        def forward(hidden_states: Tensor, position_embeddings: Any = None, _plan: RequestPlan = plan,
                    _routed: Any = routed, _bias: Tensor = bias, **_: Any) -> tuple[Tensor, None]:
            B, T = hidden_states.shape[:2]
            cos, sin = position_embeddings
            inputs = AttentionInputs(x=hidden_states, mask=mask.bool(), attn_bias=_bias,
                                     rotary=(cos.expand(B, T, -1), sin.expand(B, T, -1)))
            head_plan = condcomp.plan_from_active(_plan.heads, _plan.gates)
            return get_executor("reference")(_routed.weights(), inputs, head_plan), None

        routed.forward = forward  # type: ignore[method-assign]
    return ref(input_ids=tokens, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits


def _run(label: str, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001 - reported with the policy's name and the step
        raise AssertionError(f"{what}: {label} failed: {type(err).__name__}: {err}") from err


def _close(got: Tensor, want: Tensor, message: str, advice: str) -> None:
    diff = (got - want).abs().amax(-1)  # (B,)
    bad = (diff > TOL + TOL * want.abs().amax(-1)).nonzero().flatten().tolist()
    require(not bad, f"{message}: rows {bad}, largest |difference| {float(diff.max()):.3g} (rows have 6, 4 and 2 "
             f"prompt tokens, left-padded). Check {advice}")
