"""Extents, points and the slicing every mesh shares (Monarch's ``MeshTrait``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import DimensionNotFound


class Extent(Mapping[str, int]):
    """Named dimension sizes, e.g. ``{hosts: 2, gpus: 4}``."""

    __slots__ = ("_labels", "_sizes")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        if len(labels) != len(sizes):
            raise ValueError(f"labels {list(labels)} and sizes {list(sizes)} differ in length")
        self._labels = tuple(labels)
        self._sizes = tuple(int(s) for s in sizes)

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def nelements(self) -> int:
        return math.prod(self._sizes)

    def __getitem__(self, label: str) -> int:
        try:
            return self._sizes[self._labels.index(label)]
        except ValueError:
            raise DimensionNotFound(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return self._labels == other._labels and self._sizes == other._sizes
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._labels, self._sizes))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{l}: {s}" for l, s in zip(self._labels, self._sizes)) + "}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Extent, (self._labels, self._sizes))


class Point(Mapping[str, int]):
    """A rank within an :class:`Extent`; maps each label to a coordinate."""

    __slots__ = ("_rank", "_extent")

    def __init__(self, rank: int, extent: Extent) -> None:
        if not 0 <= rank < max(extent.nelements, 1):
            raise IndexError(f"rank {rank} out of range for extent {extent}")
        self._rank = rank
        self._extent = extent

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def extent(self) -> Extent:
        return self._extent

    def size(self, label: str) -> int:
        return self._extent[label]

    def _coords(self) -> list[int]:
        out, r = [], self._rank
        for s in reversed(self._extent._sizes):
            out.append(r % s)
            r //= s
        return out[::-1]

    def __getitem__(self, label: str) -> int:
        try:
            i = self._extent._labels.index(label)
        except ValueError:
            raise DimensionNotFound(label) from None
        return self._coords()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._extent._labels)

    def __len__(self) -> int:
        return len(self._extent)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._rank == other._rank and self._extent == other._extent
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._rank, self._extent))

    def __repr__(self) -> str:
        c = self._coords()
        return "{" + ", ".join(f"'{l}': {x}/{s}" for l, x, s in zip(self._extent._labels, c, self._extent._sizes)) + "}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Point, (self._rank, self._extent))


class View:
    """Labels and sizes over a flat list of indices into a base list (row-major)."""

    __slots__ = ("labels", "sizes", "ranks")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int], ranks: Sequence[int] | None = None) -> None:
        self.labels = tuple(labels)
        self.sizes = tuple(sizes)
        self.ranks = tuple(range(math.prod(self.sizes))) if ranks is None else tuple(ranks)

    @property
    def extent(self) -> Extent:
        return Extent(self.labels, self.sizes)

    def _strides(self) -> list[int]:
        st, acc = [], 1
        for s in reversed(self.sizes):
            st.append(acc)
            acc *= s
        return st[::-1]

    def slice(self, **kw: int | slice) -> View:
        for k in kw:
            if k not in self.labels:
                raise TypeError(f"Shape does not have dimension labeled {k!r}")
        ranges: list[range] = []
        for label, size in zip(self.labels, self.sizes):
            v = kw.get(label)
            if v is None:
                ranges.append(range(size))
            elif isinstance(v, slice):
                r = range(size)[v]
                if not r:
                    # as Monarch: a mesh with no members is an error here (a call to it would
                    # wait forever for zero answers)
                    raise ValueError(f"empty range {v.start}:{v.stop}:{v.step or 1} for dimension {label!r}")
                ranges.append(r)
            else:
                if not 0 <= v < size:
                    raise IndexError("index out of range")
                ranges.append(range(v, v + 1))
        strides = self._strides()
        idx = [0]
        for r, st in zip(ranges, strides):
            idx = [i + j * st for i in idx for j in r]
        labels = [l for l in self.labels if not isinstance(kw.get(l), int)]
        sizes = [len(r) for l, r in zip(self.labels, ranges) if not isinstance(kw.get(l), int)]
        return View(labels, sizes, [self.ranks[i] for i in idx])

    def flatten(self, name: str) -> View:
        return View([name], [len(self.ranks)], self.ranks)

    def split(self, **kw: Any) -> View:
        labels, sizes = list(self.labels), list(self.sizes)
        new_sizes = {k: v for k, v in kw.items() if k not in self.labels}
        out_l: list[str] = []
        out_s: list[int] = []
        for label, size in zip(labels, sizes):
            if label not in kw:
                out_l.append(label)
                out_s.append(size)
                continue
            names = kw[label]
            if isinstance(names, str) or not isinstance(names, Sequence):
                raise ValueError(f"split of {label!r} needs a sequence of new names, got {names!r}")
            known = [new_sizes.pop(n, None) for n in names]
            unknown = [i for i, s in enumerate(known) if s is None]
            if len(unknown) > 1 and len(names) > 1:
                raise ValueError(f"split of {label!r}: at most one size may be inferred, give sizes for {list(names)}")
            prod = math.prod(s for s in known if s is not None)
            if size % prod:
                raise ValueError(f"Dimension {label!r} of size {size} is not evenly divided by {prod}")
            if unknown:
                known[unknown[0]] = size // prod
            elif prod != size:
                raise ValueError(f"Dimension {label!r} of size {size} is not evenly divided by {prod}")
            out_l.extend(names)
            out_s.extend(int(s) for s in known)
        if new_sizes:
            raise ValueError(f"unused size constraints: {tuple(new_sizes)}")
        if len(set(out_l)) != len(out_l):
            raise ValueError("Duplicate dimension name")
        return View(out_l, out_s, self.ranks)

    def rename(self, **kw: str) -> View:
        return self.split(**{k: (v,) for k, v in kw.items()})


_T = TypeVar("_T", bound="MeshTrait")


class MeshTrait:
    """Shape operations shared by host, proc, actor and value meshes."""

    _view: View

    def _with_view(self: _T, view: View) -> _T:
        raise NotImplementedError

    def slice(self: _T, **kwargs: int | slice) -> _T:
        """Select along named dimensions: an int drops the dimension, a slice keeps it."""
        return self._with_view(self._view.slice(**kwargs))

    def flatten(self: _T, name: str) -> _T:
        """Collapse every dimension into one named ``name``."""
        return self._with_view(self._view.flatten(name))

    def split(self: _T, **kwargs: Any) -> _T:
        """Split dimensions: ``split(host=("dp", "pp"), pp=2)``."""
        return self._with_view(self._view.split(**kwargs))

    def rename(self: _T, **kwargs: str) -> _T:
        return self._with_view(self._view.rename(**kwargs))

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        if dim is None:
            return len(self._view.ranks)
        dims = [dim] if isinstance(dim, str) else list(dim)
        ext = self._view.extent
        return math.prod(ext[d] for d in dims)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self._view.labels, self._view.sizes))

    @property
    def extent(self) -> Extent:
        return self._view.extent

    def __len__(self) -> int:
        return len(self._view.ranks)
