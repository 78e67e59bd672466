"""A radix tree over token ids, as SGLang's RadixCache: how many leading tokens of a request the server
already holds (`cached_tokens`). The dev server (backends/devserver.py) reports it, so routing benchmarks and
tests see the prefix reuse a sticky router earns."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "children", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None):
        self.key = key  # the edge label from the parent
        self.children: dict[int, _Node] = {}  # first token of the child's key -> child
        self.parent = parent


def _common(key: tuple[int, ...], ids: Sequence[int], i: int) -> int:
    """Length of the common prefix of `key` and `ids[i:]`."""
    n = len(key)
    if tuple(ids[i : i + n]) == key:
        return n
    j = 0
    while j < n and i + j < len(ids) and key[j] == ids[i + j]:
        j += 1
    return j


class PrefixCache:
    """What a server has seen, as SGLang's radix cache would hold it: a radix tree over token ids whose
    least recently used leaves are trimmed once it holds more than `max_tokens` tokens."""

    def __init__(self, max_tokens: int = 1 << 20):
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        self.root = _Node((), None)
        self.size = 0  # tokens held
        self._leaves: OrderedDict[_Node, None] = OrderedDict()  # least recently used first

    def match(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of `ids` already in the cache."""
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            j = _common(child.key, ids, i)
            i += j
            if j < len(child.key):
                break
            node = child
        if node is not self.root and not node.children:
            self._leaves.move_to_end(node)
        return i

    def insert(self, ids: Sequence[int]) -> None:
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                if node is not self.root and not node.children:
                    self._leaves.pop(node, None)  # it gets a child: no longer a leaf
                child = node.children[ids[i]] = _Node(tuple(ids[i:]), node)
                self._leaves[child] = None
                self.size += len(ids) - i
                node = child
                break
            j = _common(child.key, ids, i)
            if j < len(child.key):  # split the edge: the shared part becomes an inner node
                mid = node.children[ids[i]] = _Node(child.key[:j], node)
                child.key, child.parent = child.key[j:], mid
                mid.children[child.key[0]] = child
                child = mid
            i += j
            node = child
        if node is not self.root and not node.children:
            self._leaves.move_to_end(node)
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_tokens and self._leaves:
            leaf = next(iter(self._leaves))
            excess = self.size - self.max_tokens
            if len(leaf.key) > excess:  # trim the tail, keep the shared head
                leaf.key = leaf.key[: len(leaf.key) - excess]
                self.size -= excess
                return
            del self._leaves[leaf]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)  # as old as the leaf it held
