"""A model from a Hugging Face config.json file (read from disk; nothing is downloaded).

`model_from_config(config)` reads the fields transformers' configuration classes read:

- the KV shape: `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (default:
  the attention heads), `head_dim` (default: `hidden_size / num_attention_heads`); a
  multimodal config's `text_config` when it has one;
- which layer keeps what: `layer_types` (`full_attention`, `sliding_attention` with
  `sliding_window`, `chunked_attention` with `attention_chunk_size`, `linear_attention`: a
  Gated DeltaNet state of the `linear_*` fields), or, without it, the rules transformers
  derives it by: `full_attention_interval` (Qwen3-Next: full where (i + 1) % interval == 0),
  `sliding_window_pattern` (Gemma 3: global where (i + 1) % pattern == 0), `no_rope_layers`
  (Llama 4: 1 = RoPE, chunked; 0 = NoPE, global), gpt-oss's alternation from a sliding layer,
  and a `sliding_window` on every layer (Mistral 7B v0.1) unless `use_sliding_window` is false
  (Qwen2);
- MLA: `kv_lora_rank` and `qk_rope_head_dim` (DeepSeek-V2/V3): one latent group.

A model whose every layer is full attention comes back as a uniform `ModelPreset`; any other
as a `HybridModel`. A config.json holds no parameter count, so the cost model's is estimated
from the shapes (`estimate_params`). A field the model needs that is missing or of the wrong
kind raises `ConfigError` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.sim.hybrid_presets import (
    CHUNKED_LOCAL,
    FULL,
    MLA_LATENT,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    HybridModel,
    LayerGroup,
    gated_deltanet_state_bytes,
)
from kvpool.sim.presets import ModelPreset


class ConfigError(ValueError):
    """A config.json the simulator cannot read a model from; the message names the field."""


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config.json is a JSON object, got {type(config).__name__}")
    return config


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be an object, got {text!r}")
    return text


def _int(config: dict[str, Any], name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise ConfigError(f"the config has no {name}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _head_dim(config: dict[str, Any]) -> int:
    if config.get("head_dim") is not None:
        return _int(config, "head_dim")
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"no head_dim, and hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads}"
        )
    return hidden // heads


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's type, as transformers names it (`full_attention`, ...)."""
    n = _int(config, "num_hidden_layers")
    given = config.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
            raise ConfigError(f"layer_types must be a list of strings, got {given!r}")
        if len(given) != n:
            raise ConfigError(f"layer_types has {len(given)} entries, num_hidden_layers is {n}")
        return list(given)
    if config.get("full_attention_interval") is not None:
        k = _int(config, "full_attention_interval")
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    if config.get("sliding_window_pattern") is not None and config.get("sliding_window"):
        p = _int(config, "sliding_window_pattern")
        return ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
    if config.get("no_rope_layers") is not None and config.get("attention_chunk_size"):
        flags = config["no_rope_layers"]
        if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
            raise ConfigError(
                f"no_rope_layers must list 0 or 1 for each of the {n} layers, got {flags!r}"
            )
        return ["chunked_attention" if flags[i] else "full_attention" for i in range(n)]
    window = config.get("sliding_window")
    if config.get("model_type") == "gpt_oss" and window:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if window and config.get("use_sliding_window", True):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _state_bytes(config: dict[str, Any]) -> int:
    return gated_deltanet_state_bytes(
        _int(config, "linear_num_value_heads"),
        _int(config, "linear_num_key_heads"),
        _int(config, "linear_key_head_dim"),
        _int(config, "linear_value_head_dim"),
        _int(config, "linear_conv_kernel_dim"),
    )


def _groups(config: dict[str, Any], types: list[str]) -> tuple[LayerGroup, ...]:
    heads = _int(config, "num_key_value_heads", config.get("num_attention_heads"))
    head_dim = _head_dim(config)
    groups = []
    # One group per layer type, in the order the types first occur (layer 0's first).
    for t in dict.fromkeys(types):
        layers = tuple(i for i, u in enumerate(types) if u == t)
        if t == "full_attention":
            groups.append(LayerGroup(FULL, layers, heads, head_dim))
        elif t == "sliding_attention":
            window = _int(config, "sliding_window")
            groups.append(LayerGroup(SLIDING_WINDOW, layers, heads, head_dim, window=window))
        elif t == "chunked_attention":
            chunk = _int(config, "attention_chunk_size")
            groups.append(LayerGroup(CHUNKED_LOCAL, layers, heads, head_dim, window=chunk))
        elif t == "linear_attention":
            groups.append(
                LayerGroup(RECURRENT_STATE, layers, state_bytes_per_layer=_state_bytes(config))
            )
        else:
            raise ConfigError(
                f"layer type {t!r} (layer {layers[0]}) is not modelled; the simulator knows "
                "full_attention, sliding_attention, chunked_attention and linear_attention"
            )
    return tuple(groups)


def _experts(config: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts, experts per token, shared experts); (0, 0, 0) for a dense model."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(name):
            routed = _int(config, name)
            per_token = _int(config, "num_experts_per_tok", 1)
            shared = config.get("n_shared_experts") or (
                1 if config.get("shared_expert_intermediate_size") else 0
            )
            return routed, per_token, int(shared)
    return 0, 0, 0


def estimate_params(config: dict[str, Any]) -> tuple[float, float]:
    """(total, active per token) weights from the shapes: embeddings (twice unless
    `tie_word_embeddings`; a token multiplies only the output one), per layer the attention projections (q and o of
    num_attention_heads x head_dim, k and v of num_key_value_heads x head_dim) and a gated
    MLP of 3 x hidden x intermediate per expert (`moe_intermediate_size` for routed experts,
    `shared_expert_intermediate_size` for a shared one). Norms, biases, routers, MLA's and
    linear attention's own projections (taken as an attention layer's) are left out: it
    sizes the cost model's weight reads, within a few percent for the Llama-like models."""
    hidden = _int(config, "hidden_size")
    n = _int(config, "num_hidden_layers")
    q_heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", q_heads)
    head_dim = _head_dim(config)
    vocab = _int(config, "vocab_size")
    embed = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    lm_head = vocab * hidden  # a token multiplies the output projection; the input is a lookup
    attention = 2 * hidden * head_dim * (q_heads + kv_heads)
    routed, per_token, shared = _experts(config)
    dense_mlp = 3 * hidden * _int(config, "intermediate_size")
    if routed == 0:
        per_layer = attention + dense_mlp
        return float(embed + n * per_layer), float(lm_head + n * per_layer)
    expert = 3 * hidden * _int(config, "moe_intermediate_size", config.get("intermediate_size"))
    shared_mlp = (
        shared
        * 3
        * hidden
        * int(
            config.get("shared_expert_intermediate_size")
            or config.get("moe_intermediate_size")
            or 0
        )
    )
    total = embed + n * (attention + routed * expert + shared_mlp)
    active = lm_head + n * (attention + per_token * expert + shared_mlp)
    return float(total), float(active)


def model_from_config(config: dict[str, Any], name: str) -> ModelPreset | HybridModel:
    """The model a config.json describes: a uniform preset when every layer is full
    attention, else a hybrid model (see the module's docstring)."""
    text = _text_config(config)
    n = _int(text, "num_hidden_layers")
    q_heads = _int(text, "num_attention_heads")
    total, active = estimate_params(text)
    source = f"config.json fields (parameters estimated from the shapes: {total:.3g})"
    if text.get("kv_lora_rank") is not None:
        group = LayerGroup(
            MLA_LATENT,
            tuple(range(n)),
            latent_dim=_int(text, "kv_lora_rank"),
            rope_dim=_int(text, "qk_rope_head_dim"),
        )
        return HybridModel(name, n, (group,), q_heads, total, active, block_size=64, source=source)
    types = layer_types(text)
    groups = _groups(text, types)
    if len(groups) == 1 and groups[0].kind == FULL:
        g = groups[0]
        return ModelPreset(name, n, g.num_kv_heads, g.head_dim, q_heads, total)
    return HybridModel(name, n, groups, q_heads, total, active, source=source)


def model_from_file(path: Path) -> ModelPreset | HybridModel:
    """The model of a config.json file, named after its folder (or the file's stem)."""
    path = Path(path)
    config = load_config(path)
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return model_from_config(config, name or "config")
