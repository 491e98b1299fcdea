"""Which safetensors file of a Hugging Face model folder holds each tensor, and each tensor's
checked header entry: pure python, every file read through formats.safe_files and
formats.safetensors_header before any tensor is.

A sharded model lists its tensors in `model.safetensors.index.json` (`{"weight_map": {tensor:
file}}`); the file names come from whoever made the folder, so each must be a string naming a
regular file inside the folder: `../x` or `/etc/x` is refused, never followed. Without an index,
the folder's `*.safetensors` files are read (a directory of that name is refused by name).
"""

from __future__ import annotations

import os
from pathlib import Path

from formats.errors import UserError
from formats.safe_files import inside_folder, load_strict_json
from formats.safetensors_header import FLOAT_DTYPES, TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
"""An index lists one line per tensor: a few hundred kB for the largest public models."""


def index_map(folder: Path, where: str) -> dict[str, Path]:
    """{tensor: file} of the folder's index, every file name checked to stay inside it."""
    index = folder / INDEX_NAME
    obj = load_strict_json(index, f"{where}:", MAX_INDEX_BYTES)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"{where}: {index} is not a safetensors index (expected an object with "
                        "a \"weight_map\" object of tensor name: file name)")
    return {name: inside_folder(folder, file, f"{where}: {INDEX_NAME} entry {name}")
            for name, file in weight_map.items()}


class FolderWeights:
    """The tensors of a model folder: name -> (file, header entry), headers read and checked
    once per file."""

    def __init__(self, folder: str | os.PathLike, where: str) -> None:
        self.folder, self.where = Path(folder), where
        self.headers: dict[Path, dict[str, TensorEntry]] = {}
        index = self.folder / INDEX_NAME
        if index.exists() or index.is_symlink():
            self.files = index_map(self.folder, where)
            for path in dict.fromkeys(self.files.values()):
                self._header(path)  # a missing, special or damaged file: named now
        else:
            found = sorted(self.folder.glob("*.safetensors"))
            if not found:
                raise UserError(f"{where}: no *.safetensors files and no {INDEX_NAME}")
            self.files = {name: path for path in found for name in self._header(path)}

    def _header(self, path: Path) -> dict[str, TensorEntry]:
        if path not in self.headers:
            if not path.exists():
                raise UserError(f"{self.where}: {path.name} (listed in {INDEX_NAME}) does not "
                                "exist")
            self.headers[path] = read_header(path, f"{self.where}:")
        return self.headers[path]

    def entry(self, name: str, shape: tuple[int, ...]) -> tuple[Path, TensorEntry]:
        """The file and entry of tensor `name`, checked to have `shape` and a float dtype."""
        path = self.files.get(name)
        if path is None:
            raise UserError(f"{self.where}: tensor {name} is missing (the model's config needs "
                            "it)")
        entry = self._header(path).get(name)
        if entry is None:
            raise UserError(f"{self.where}: {INDEX_NAME} puts tensor {name} in {path.name}, "
                            "which does not hold it")
        if entry.shape != tuple(shape):
            raise UserError(f"{self.where}: tensor {name} has shape {list(entry.shape)}, the "
                            f"model needs {list(shape)} (another config or vocabulary?)")
        if entry.dtype not in FLOAT_DTYPES:
            raise UserError(f"{self.where}: tensor {name} has dtype {entry.dtype}, not a float")
        return path, entry
