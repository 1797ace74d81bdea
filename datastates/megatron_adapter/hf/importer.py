"""A Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` directory -> universal checkpoint.

Reads ``config.json`` and the safetensors weights (``model.safetensors``, or the shards that
``model.safetensors.index.json`` names, any number) and writes them with `write_universal`
(checksummed, committed last). Nothing is unpickled: a directory with only ``pytorch_model.bin``
is refused. Names map through the same `Layout` `to-hf` uses (`llama`, `gpt2`), each
megatron tensor joined from its Hugging Face tensors and the layers stacked, so `to-hf` of the
result gives back the same tensors bit for bit.

The result is a *release* checkpoint, as Megatron-LM's own converters write: iteration 0, no
optimizer state, no RNG, no consumed samples (manifest ``release: true``, ``optimizer: null``).
``pretrain_gpt.py --load`` starts from it as Megatron-LM starts from a release checkpoint (what
``--finetune --no-load-optim --no-load-rng`` do for another one): fresh optimizer and
learning-rate schedule, iteration 0. The vocabulary is stored unpadded (``vocab_unpadded: true``):
a run at any TP pads it to its own size, the rows past it starting at zero (megatron-core's
vocabulary padding on load).

Call order: `read_model` (config.json -> `HfModel`), then `import_hf` (both in one), or
`HfSource` for `write_universal` directly; `launch_flags` gives the pretrain_gpt.py flags.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...fileio import read_confined, safe_join
from ...universal import DTYPE_NAMES, Entry, MergeResult, MergeSource, Role, encode_value, \
    write_universal
from ...universal.objects import DTYPE_BY_NAME
from ...universal.tensor_files import TensorFile
from .common import DTYPES, Layout, Rule
from .gpt2 import gpt2_layout, gpt2_model_config
from .llama import llama_layout, llama_model_config

__all__ = ["HF_SOURCE", "HfModel", "HfSource", "HfWeights", "hf_root", "import_hf",
           "launch_flags", "read_model"]

HF_SOURCE = "hugging_face"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Weight files that are pickles (or other formats from-hf does not read).
_OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
                  "flax_model.msgpack")
#: Buffers some Hugging Face saves hold that carry no weights (causal masks, rope frequencies).
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
SUPPORTED = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
_SUPPORTED_TEXT = "from-hf converts " + " and ".join(SUPPORTED)
#: config.json sizes each mapping reads.
_SIZES = {"llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "max_position_embeddings"),
          "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")}


@dataclass(frozen=True)
class HfModel:
    """What config.json says: the architecture, the layout's config, megatron's model config (the
    run config's ``model`` section, vocabulary and dtype filled in from the weights) and the
    mapping."""

    architecture: str
    config: dict
    cfg: dict
    model: dict
    layout: Layout
    base_prefix: str  # saved from the base model (GPT2Model), names lack it: "h.0.ln_1.weight"


def hf_root(directory: str) -> str:
    """The directory reads of `directory` stay inside: itself, or for a snapshot of the Hugging
    Face hub cache (``models--org--name/snapshots/<revision>/``, whose files are links to
    ``../../blobs/``) that model's cache directory. A link anywhere else is refused."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and \
            os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
        return os.path.dirname(parent)
    return real


def _read_json(path: str, directory: str) -> Any:
    try:
        return json.loads(read_confined(path, directory=hf_root(directory),
                                        what=os.path.basename(path)))
    except ValueError as e:
        raise CheckpointError(f"not valid JSON: {e}", file=path) from None


def read_model(directory: str, approximate_gelu_ok: bool = False) -> HfModel:
    """The model config.json in `directory` describes, refused in one line when its architecture
    is not one we convert or uses a part megatron's GPT cannot express."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {CONFIG}: expected a Hugging Face model directory "
                              f"(save_pretrained's output); {_SUPPORTED_TEXT}", file=directory)
    config = _read_json(path, directory)
    if not isinstance(config, dict):
        raise CheckpointError(f"expected a JSON object, found {type(config).__name__}", file=path)
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    arch = archs[0] if len(archs) == 1 else None
    if arch is None and not archs:  # older configs name only the model type
        arch = {v: k for k, v in SUPPORTED.items()}.get(model_type)
    if arch not in SUPPORTED:
        raise CheckpointError(f"config.json names architecture {', '.join(archs) or 'none'} "
                              f"(model_type {model_type!r}); {_SUPPORTED_TEXT}", file=path)
    bad = [k for k in _SIZES[SUPPORTED[arch]]
           if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)
           or config[k] <= 0]
    if bad:
        raise CheckpointError(f"a {arch} config.json needs positive integer "
                              f"{', '.join(_SIZES[SUPPORTED[arch]])}; found "
                              f"{', '.join(f'{k}={config.get(k)!r}' for k in bad)}", file=path)
    try:
        if SUPPORTED[arch] == "llama":
            cfg, model = llama_model_config(config, path)
            return HfModel(arch, config, cfg, model, llama_layout(cfg), "model.")
        cfg, model = gpt2_model_config(config, path, approximate_gelu_ok)
        return HfModel(arch, config, cfg, model, gpt2_layout(cfg), "transformer.")
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"a {arch} config.json with a missing or malformed field "
                              f"({type(e).__name__}: {e}); expected what save_pretrained "
                              "writes", file=path) from None


class HfWeights:
    """The safetensors files of a Hugging Face directory, each tensor's file known and every file
    checked to exist and to hold what the index puts in it before any tensor is read."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX)
        if os.path.isfile(index_path):
            index = _read_json(index_path, directory)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError("expected a non-empty weight_map object", file=index_path)
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            weight_map = None
        else:
            found = [f for f in _OTHER_WEIGHTS if os.path.exists(os.path.join(directory, f))]
            raise CheckpointError(
                f"found {', '.join(found)} and no {SINGLE} or {INDEX}: from-hf reads safetensors "
                "only (a pickle can run code); save the model with transformers' save_pretrained "
                "(safetensors by default) where you trust it, and convert that" if found else
                f"no {SINGLE} or {INDEX}: expected the weights as safetensors next to {CONFIG}",
                file=directory)
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        root = hf_root(directory)
        missing = [f for f in files
                   if not os.path.isfile(safe_join(directory, f, what=INDEX, confine_to=root))]
        if missing:
            raise CheckpointError(f"{INDEX} names {len(files)} shard files and {len(missing)} "
                                  f"of them are missing ({', '.join(missing[:3])}"
                                  f"{', ...' if len(missing) > 3 else ''}): the download or copy "
                                  "is incomplete; expected every shard next to the index",
                                  file=directory)
        self._files: Dict[str, TensorFile] = {}
        self._where: Dict[str, Tuple[str, str, Tuple[int, ...]]] = {}
        try:
            for f in files:
                tf = self._files[f] = TensorFile(os.path.join(directory, f), root,
                                                 what=f"weight file {f!r}")
                listing = tf.listing()
                names = [n for n, v in weight_map.items() if v == f] if weight_map else listing
                for name in names:
                    if name not in listing:
                        raise CheckpointError(f"{INDEX} puts this tensor in {f}, whose header "
                                              "does not hold it (a shard from another download?)",
                                              file=os.path.join(directory, f), tensor=name)
                    self._where[name] = (f,) + listing[name]
        except BaseException:
            self.close()
            raise

    def names(self) -> List[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def meta(self, name: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        f, dtype, shape = self._where[name]
        if dtype not in DTYPE_BY_NAME:
            raise CheckpointError(f"tensor of dtype {dtype!r}; expected one of "
                                  f"{sorted(DTYPE_BY_NAME)}", file=os.path.join(self.directory, f),
                                  tensor=name)
        return DTYPE_BY_NAME[dtype], shape

    def read(self, name: str) -> torch.Tensor:
        """A copy of the tensor (its file is memory-mapped; only its bytes are read)."""
        dtype, shape = self.meta(name)
        tf = self._files[self._where[name][0]]
        start, _ = tf.span(name, dtype, shape)
        return tf.tensor_of(start, dtype, shape).clone()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class HfSource(MergeSource):
    """A Hugging Face model directory as a `MergeSource` for `write_universal` (one process)."""

    kind = HF_SOURCE

    def __init__(self, directory: str, approximate_gelu_ok: bool = False):
        self.directory = directory
        self.hf = read_model(directory, approximate_gelu_ok)
        self.weights = HfWeights(directory)
        try:
            self._names = self._resolve_names()
            self._entries = self._plan()
        except BaseException:
            self.weights.close()
            raise

    def _resolve_names(self) -> Dict[str, str]:
        """Layout name -> the name in the files (a base model's lack the head's prefix); refused
        when a tensor the layout needs is missing or the files hold one it does not read."""
        prefix = self.hf.base_prefix
        wanted = self.hf.layout.hf_names()
        names = {n: n if self.weights.has(n) or not n.startswith(prefix) else n[len(prefix):]
                 for n in wanted}
        missing = [n for n in wanted if not self.weights.has(names[n])]
        if missing:
            raise CheckpointError(f"the weights lack {len(missing)} tensor(s) a "
                                  f"{self.hf.architecture} with this config.json has, e.g. "
                                  f"{missing[:3]} (config.json of another model?)",
                                  file=self.directory)
        used = set(names.values())
        if self.hf.cfg["tie_word_embeddings"]:
            used.add("lm_head.weight")  # a tied head saved anyway is the embedding
        extra = [n for n in self.weights.names() if n not in used and not n.endswith(_BUFFERS)]
        if extra:
            raise CheckpointError(f"the weights hold {len(extra)} tensor(s) a plain "
                                  f"{self.hf.architecture} does not have, e.g. {extra[:3]}; "
                                  f"{_SUPPORTED_TEXT} without extra parts", file=self.directory)
        return names

    def _parts(self, rule: Rule, i: int) -> List[str]:
        return [self._names[n.format(i=i)] for n in rule.hf]

    def _layers(self, rule: Rule) -> range:
        return range(self.hf.layout.num_layers) if rule.layered else range(1)

    def _join(self, rule: Rule, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        joined = [rule.join([read(n) for n in self._parts(rule, i)]) for i in self._layers(rule)]
        return torch.stack(joined) if rule.layered else joined[0]

    def _plan(self) -> List[Entry]:
        """One entry per megatron tensor, its shape found by joining meta tensors (no data)."""
        entries, dtypes = [], set()
        for rule in self.hf.layout.rules():
            def meta(name: str) -> torch.Tensor:
                dtype, shape = self.weights.meta(name)
                dtypes.add(dtype)
                return torch.empty(shape, dtype=dtype, device="meta")
            try:
                t = self._join(rule, meta)
            except RuntimeError as e:  # shapes that do not fit the config
                parts = self._parts(rule, 0)
                shapes = [list(self.weights.meta(n)[1]) for n in parts]
                raise CheckpointError(f"tensors {parts} have shapes {shapes} that config.json's "
                                      f"sizes do not explain ({e})", file=self.directory) from None
            entries.append(Entry(rule.key, Role.WEIGHT, rule.key, rule.key, t.dtype,
                                 tuple(t.shape)))
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
            raise CheckpointError(f"weights are stored as {sorted(DTYPE_NAMES[d] for d in dtypes)};"
                                  f" expected one of {sorted(DTYPES.values())} for all of them",
                                  file=self.directory)
        return entries

    @property
    def model(self) -> dict:
        """megatron's model config, with the vocabulary and dtype the weights have."""
        vocab = self._entry("embedding.word_embeddings.weight").shape[0]
        dtype = self._entries[0].dtype
        return dict(self.hf.model, vocab_size=vocab, padded_vocab_size=vocab,
                    bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)

    def _entry(self, key: str) -> Entry:
        return next(e for e in self._entries if e.key == key)

    def iteration(self) -> int:
        return 0

    def objects(self) -> Dict[str, Any]:
        return {}

    def entries(self) -> List[Entry]:
        return list(self._entries)

    def read(self, key: str) -> torch.Tensor:
        rule = next(r for r in self.hf.layout.rules() if r.key == key)
        return self._join(rule, self.weights.read).contiguous()

    def manifest_fields(self) -> Dict[str, Any]:
        model = self.model
        return {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0,
                "checkpoint_version": None, "scheduler": None, "optimizer": None,
                "model_config": model,
                "tokenizer": {"tokenizer_type": None, "vocab_size": model["vocab_size"],
                              "padded_vocab_size": model["padded_vocab_size"],
                              "make_vocab_size_divisible_by": None},
                "source": {"format": HF_SOURCE, "directory": self.directory,
                           "layout": f"Hugging Face {self.hf.architecture}"},
                "run_config": {"model": model}, "megatron_common": encode_value({"iteration": 0}),
                "release": True, "vocab_unpadded": True,
                "hugging_face": {"architecture": self.hf.architecture, "config": self.hf.config}}

    def close(self) -> None:
        self.weights.close()


def import_hf(src: str, dst: str, progress: Optional[Callable[[int, int, str], None]] = None,
              max_file_bytes: int = 2 << 30,
              approximate_gelu_ok: bool = False) -> Tuple[MergeResult, dict]:
    """Convert the Hugging Face model directory `src` into the committed universal checkpoint
    `dst` (refused if it holds files; a failure leaves nothing there). Returns the write's result
    and megatron's model config."""
    if os.path.isdir(dst) and os.listdir(dst):
        raise CheckpointError("output directory is not empty; choose a new one", file=dst)
    source = HfSource(src, approximate_gelu_ok)
    counted = None
    if progress is not None:
        names = [e.name for e in source.entries()]
        counted = lambda done, total, name: progress(  # noqa: E731
            done, total, f"tensor {names.index(name) + 1}/{len(names)} {name}")
    try:
        result = write_universal(source, dst, max_file_bytes=max_file_bytes, progress=counted)
        return result, source.model
    finally:
        source.close()


def launch_flags(model: dict) -> List[str]:
    """pretrain_gpt.py's model flags for megatron's model config `model` (NullTokenizer's
    ``--vocab-size`` counts the ids without its end-of-document id, the model's last)."""
    flags = ["--num-layers", model["num_layers"], "--hidden-size", model["hidden_size"],
             "--num-attention-heads", model["num_attention_heads"],
             "--ffn-hidden-size", model["ffn_hidden_size"], "--seq-length", model["seq_length"],
             "--max-position-embeddings", model["max_position_embeddings"],
             "--tokenizer-type", "NullTokenizer", "--vocab-size", model["vocab_size"] - 1,
             "--norm-epsilon", model["norm_epsilon"], "--init-method-std",
             model["init_method_std"], "--hidden-dropout", model["hidden_dropout"],
             "--attention-dropout", model["attention_dropout"]]
    if model["position_embedding_type"] == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", model["rotary_base"]]
    if model["normalization"] == "RMSNorm":
        flags += ["--normalization", "RMSNorm"]
    if model["swiglu"]:
        flags.append("--swiglu")
    if model["num_query_groups"]:
        flags += ["--group-query-attention", "--num-query-groups", model["num_query_groups"]]
    if not model["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if model["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--bf16"] if model.get("bf16") else ["--fp16"] if model.get("fp16") else []
    return [str(f) for f in flags]
