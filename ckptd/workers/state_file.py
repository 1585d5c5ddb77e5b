"""The files of ``save_state_async``'s default writer, and :func:`load_state`, which reads them back.

A flat dict of named tensors (a model's state dict) is one safetensors file. Any other state, such
as an optimizer's state dict (dicts, lists and tuples of tensors and plain values, with integer
keys), is two files:

    {name}.safetensors    every tensor, named by where it sits ("state/0/exp_avg")
    {name}.state.json     the structure: the containers, the plain values, and the tensors by name

The tensors file of a nested state says so in its metadata (``"ckptd.structure"``), so a
structure file left by another save of the same name and step is never paired with it. Both
files are written from the staged snapshot, the tensors from the file's staged image like a flat
state's (see :class:`~ckptd.coordinator.staging.BufferSet`), and both load back without
unpickling anything. In the JSON, a tensor is ``{"tensor": name}``, a dict ``{"dict": [[key,
value], ...]}`` (keys keep their type: str, int, float, bool or None), a list ``{"list": [...]}``,
a tuple ``{"tuple": [...]}``, a float that is not finite ``{"float": "nan"}``; str, int, bool,
None and finite floats are themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ckptd.errors import CheckpointConfigError, CheckpointError, CorruptCheckpointError
from ckptd.layout import parse_kind
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.workers.files import load_json, read_verified, write_json
from ckptd.workers.safetensors_io import check_tensors, write_safetensors

if TYPE_CHECKING:
    from ckptd.verify import CommittedStep

FORMAT = "ckptd.state/1"
SUFFIX = ".safetensors"
STRUCTURE_SUFFIX = ".state.json"

_PLAIN = (str, int, bool, type(None))
#: The safetensors metadata entry that says a tensors file has its structure beside it.
STRUCTURE_KEY = "ckptd.structure"
_MAX_DEPTH = 64  # containers within containers: JSON writes and reads back far deeper, with room


def is_flat(state: Any) -> bool:
    """Whether ``state`` is a flat dict of named tensors: one safetensors file, as it is."""
    return isinstance(state, Mapping) and bool(state) and all(
        isinstance(k, str) and k and isinstance(v, torch.Tensor) for k, v in state.items())


def flatten(state: Any, what: str = "state") -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of ``state`` by name, in :func:`~ckptd.workers.state_dict.map_tensors` order,
    and the JSON structure that puts them back (:func:`unflatten`). Mappings come back as dicts;
    every other value as its own type.

    Raises:
        CheckpointConfigError: ``state`` holds something other than tensors, mappings, lists,
            tuples, str, int, float, bool and None (subclasses such as an IntEnum or a namedtuple
            included, since they would come back as their base type), a dict key other than those
            plain values, an int too long for JSON, or containers more than 64 deep.
    """
    tensors: dict[str, torch.Tensor] = {}

    def where(path: list[str]) -> str:
        return what + "".join(f"[{p}]" for p in path)

    def name_of(path: list[str]) -> str:
        name = "/".join(p.strip("'") for p in path) or "tensor"
        if name in tensors or name == "__metadata__":  # safetensors keeps that key for the metadata
            n = 1
            while f"{name}~{n}" in tensors:
                n += 1
            name = f"{name}~{n}"
        return name

    def plain(obj: Any, path: list[str], role: str) -> Any:
        """``obj`` as JSON holds it, if it is a plain value; else raise."""
        if type(obj) in _PLAIN:
            if type(obj) is int:
                try:
                    str(obj)
                except ValueError:  # past sys.get_int_max_str_digits(): JSON cannot hold it
                    raise CheckpointConfigError(f"{where(path)} holds an int of {obj.bit_length()} bits, too "
                                                "long for JSON; save it as a tensor or a string") from None
            return obj
        if type(obj) is float and (math.isfinite(obj) or role == "value"):
            return obj if math.isfinite(obj) else {"float": repr(obj)}
        raise CheckpointConfigError(
            f"{where(path)} {'has a key' if role == 'key' else 'is'} a {type(obj).__name__} ({obj!r:.60}); "
            "the default writer holds tensors, and dicts, lists, tuples, str, int, float, bool and None "
            "around them (keys: str, int, float, bool or None), of exactly those types. Convert it (for "
            "example int(x), float(x), tuple(x)), or pass a write_fn (for example one that calls "
            "ckptd.workers.files.write_torch)")

    def encode(obj: Any, path: list[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            name = name_of(path)
            tensors[name] = obj
            return {"tensor": name}
        if len(path) > _MAX_DEPTH and isinstance(obj, (Mapping, list, tuple)):
            raise CheckpointConfigError(f"{where(path[:3])}... nests containers more than {_MAX_DEPTH} deep; "
                                        "the default writer keeps at most that many")
        if isinstance(obj, Mapping):
            return {"dict": [[plain(k, path, "key"), encode(v, [*path, repr(k)])] for k, v in obj.items()]}
        if type(obj) in (list, tuple):
            items = [encode(v, [*path, str(i)]) for i, v in enumerate(obj)]
            return {"list": items} if type(obj) is list else {"tuple": items}
        return plain(obj, path, "value")

    structure = {"format": FORMAT, "state": encode(state, [])}
    check_tensors(tensors, what)
    return tensors, structure


def split(state: Any, metadata: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str], dict | None]:
    """What the default writer makes of ``state``: the tensors file's tensors and metadata, and
    the structure to write beside it (None for a flat dict of tensors, written as it is).

    Raises:
        CheckpointConfigError: see :func:`flatten` and ``check_tensors``.
    """
    if is_flat(state):
        check_tensors(state, "state")
        return dict(state), dict(metadata), None
    tensors, structure = flatten(state)
    return tensors, {**metadata, STRUCTURE_KEY: FORMAT}, structure


def unflatten(structure: Any, tensors: Mapping[str, torch.Tensor], path: str = "state") -> Any:
    """The state that :func:`flatten` took apart.

    Raises:
        CorruptCheckpointError: the structure is not one ``flatten`` writes, or names a tensor
            that ``tensors`` lacks.
    """
    if not isinstance(structure, dict) or structure.get("format") != FORMAT or "state" not in structure:
        raise CorruptCheckpointError(f"{path}: not a ckptd state structure (format {FORMAT!r})")

    def decode(node: Any) -> Any:
        if isinstance(node, _PLAIN) or isinstance(node, float):
            return node
        if isinstance(node, dict) and len(node) == 1:
            (tag, value), = node.items()
            if tag == "tensor" and isinstance(value, str):
                if value not in tensors:
                    raise CorruptCheckpointError(f"{path}: names tensor {value!r}, which the tensors file lacks")
                return tensors[value]
            if tag == "dict" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
                built = {k: decode(v) for k, v in value}
                if len(built) == len(value):
                    return built
                raise CorruptCheckpointError(f"{path}: a dict in the state structure gives a key twice")
            if tag in ("list", "tuple") and isinstance(value, list):
                items = [decode(v) for v in value]
                return items if tag == "list" else tuple(items)
            if tag == "float" and value in ("nan", "inf", "-inf"):
                return float(value)
        raise CorruptCheckpointError(f"{path}: unknown node {str(node)[:80]!r} in the state structure")

    try:
        return decode(structure["state"])
    except (TypeError, RecursionError) as e:  # an unhashable key, a structure nested too deep
        raise CorruptCheckpointError(f"{path}: unreadable state structure ({e})") from e


def structure_path(path: str) -> str:
    """Where the structure of the state whose tensors are at ``path`` goes."""
    return path.removesuffix(SUFFIX) + STRUCTURE_SUFFIX


def write_state(storage: Storage, path: str, state: Any, metadata: dict[str, str],
                ready: Any = None, image: torch.Tensor | None = None) -> list[WrittenFile]:
    """``state`` as the default writer writes it: ``path`` (safetensors), and for a state that is
    not a flat dict of tensors its structure beside it (see the module's docstring)."""
    tensors, metadata, structure = split(state, metadata)
    written = [write_safetensors(storage, path, tensors, metadata, ready, image)]
    if structure is not None:
        written.append(write_json(storage, structure_path(path), structure))
    return written


def load_state(root: str, name: str, step: int | None = None, *, kind: str = "checkpoint",
               storage_options: dict | None = None) -> Any:
    """The state that ``coord.save_state_async(name, state, step)`` saved with the default writer,
    as it was saved: a flat dict of tensors, or the nested state (an optimizer's state dict, to
    pass to ``optimizer.load_state_dict``). Every file is checked against the step's manifest
    first; nothing is unpickled.

    Args:
        root: The checkpoint root.
        name: The save's name.
        step: A committed step; None for the newest committed step of ``kind``.
        kind: ``"checkpoint"`` or ``"state_dict"``, for ``step=None``.
        storage_options: fsspec options for ``root``.

    Raises:
        CheckpointError: nothing of ``kind`` is committed, or ``step`` is not committed.
        CheckpointConfigError: the step holds no state saved as ``name``.
        CorruptCheckpointError: a file differs from its manifest entry, or is malformed.
    """
    from ckptd.verify import open_step

    storage = Storage(root, storage_options)
    committed = open_step(storage, step, parse_kind(kind) if step is None else None)
    if committed is None:
        raise CheckpointError(f"no {kind} is committed under {storage.url}")
    return read_state(storage, committed, name)


def saved_states(committed: CommittedStep) -> list[str]:
    """The names of the default-writer states of a committed step."""
    return sorted(f.removesuffix(SUFFIX) for f in committed.files if f.endswith(SUFFIX) and "/" not in f)


def nested_states(committed: CommittedStep) -> list[str]:
    """The names of the default-writer states of a committed step that have a structure file:
    the only ones that can be an optimizer's state dict (a model's weights are a flat state)."""
    return [n for n in saved_states(committed) if n + STRUCTURE_SUFFIX in committed.files]


def read_state(storage: Storage, committed: CommittedStep, name: str) -> Any:
    """The state saved as ``name`` in the committed step (see :func:`load_state`).

    Raises:
        CheckpointConfigError: the step holds no state saved as ``name``.
        CorruptCheckpointError: a file differs from its manifest entry, or is malformed.
    """
    from ckptd.workers.mapped import read_safetensors

    rel = name + SUFFIX
    if rel not in committed.files:
        raise CheckpointConfigError(f"step {committed.step} has no state saved as {name!r} ({rel} is not in its "
                                    f"manifest); its default-writer states: {saved_states(committed) or 'none'}")
    path = f"{committed.path}/{rel}"
    tensors, metadata = read_safetensors(storage, path, committed.files[rel])
    if STRUCTURE_KEY not in metadata:
        if not tensors:
            raise CorruptCheckpointError(f"{path}: holds no tensors and no structure, which the default writer "
                                         "never writes")
        return tensors  # a flat state (a structure file beside it is another save's, not this one's)
    if metadata[STRUCTURE_KEY] != FORMAT:
        raise CorruptCheckpointError(f"{path}: its structure is in format {metadata[STRUCTURE_KEY]!r}; this "
                                     f"version of ckptd reads {FORMAT!r}")
    srel = name + STRUCTURE_SUFFIX
    spath = f"{committed.path}/{srel}"
    if srel not in committed.files:
        raise CorruptCheckpointError(f"{path}: its state's structure should be in {spath}, which the step's "
                                     "manifest does not list")
    return unflatten(load_json(read_verified(storage, spath, committed.files[srel]), spath), tensors, spath)
