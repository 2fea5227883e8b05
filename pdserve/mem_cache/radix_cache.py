"""Radix prefix cache over KV pages.

Each edge holds exactly one full page of tokens, so a node is one cached page. The tree owns one reference
to each of its pages; a request that reuses a prefix takes its own references. A node whose page nobody
else references is evictable; eviction is LRU over such leaves.

Neither counting nor eviction walks the tree: the allocator counts the cached pages nobody else references and
reports each page that becomes one, and eviction pops a heap of candidate leaves that is checked lazily (an
entry whose node was touched since is pushed again with its new time; one whose node was evicted, gained a
child or was referenced again is dropped, and pushed anew when it qualifies again).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.mem_cache.kv_pool import PageAllocator

_clock = itertools.count()


@dataclass(slots=True, eq=False)
class _Node:
    page: int
    parent: "_Node | None"
    key: tuple[int, ...]
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_access: int = 0
    host_page: int = -1  # tier 2 (HiRadixCache); page is -1 while only the host holds the node
    block_hash: bytes = b""  # tier-3 key of this page, computed when first needed
    stored: bool = False  # tier 3 holds this page


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node(page=-1, parent=None, key=())
        self.num_pages = 0
        self._node_of_page: dict[int, _Node] = {}
        self._candidates: list[tuple[int, int, _Node]] = []  # (last_access, tie-break, node): a lazy LRU heap
        allocator.on_cache_only = self._on_cache_only
        self.query_tokens = 0
        self.hit_tokens = 0

    def _page_keys(self, token_ids: list[int], num_pages: int):
        ps = self.page_size
        return (tuple(token_ids[i * ps : (i + 1) * ps]) for i in range(num_pages))

    def match_prefix(self, token_ids: list[int], max_tokens: int, rid: str | None = None) -> list[int]:
        """Pages caching the longest full-page prefix of token_ids[:max_tokens]; the caller gets a reference to each.

        `rid` names the request (a hierarchical cache pairs it with the prefetch started for it)."""
        pages = [n.page for n in self._walk(token_ids, max_tokens // self.page_size, touch=True)]
        self.allocator.incref(pages)
        return pages

    def _walk(self, token_ids: list[int], max_pages: int, touch: bool) -> list[_Node]:
        """The nodes of the longest cached path along token_ids' first max_pages pages (touched: now recent)."""
        path, node, now = [], self.root, next(_clock)
        for key in self._page_keys(token_ids, max_pages):
            node = node.children.get(key)
            if node is None:
                break
            if touch:
                node.last_access = now
            path.append(node)
        return path

    def reset_hit_counts(self) -> None:
        self.query_tokens = self.hit_tokens = 0

    def record_hit(self, query_tokens: int, hit_tokens: int) -> None:
        """Hit statistics, counted once per admitted request (a refused admission is retried later)."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        """Cache the full pages of token_ids (pages[i] holds tokens of page i). Caller keeps its own references."""
        node, now = self.root, next(_clock)
        num_full = min(len(token_ids) // self.page_size, len(pages))
        for i, key in enumerate(self._page_keys(token_ids, num_full)):
            child = node.children.get(key)
            if child is None:
                child = _Node(page=-1, parent=node, key=key)
                node.children[key] = child
            if child.page < 0:  # new, or held only by a lower tier: the request's page becomes the cached one
                self.allocator.incref([pages[i]])
                self._attach_page(child, pages[i])
                self.num_pages += 1
                self._on_cached(child)
            child.last_access = now
            node = child

    def _on_cached(self, node: _Node) -> None:
        """Hook: node's device page just entered the tree (the hierarchical cache writes it through)."""

    def prefetch(self, rid: str, token_ids: list[int]) -> None:
        """Hook: a request was queued; a hierarchical cache starts fetching its prefix from storage."""

    def wait_for_loads(self) -> None:
        """Hook: called before a forward pass; a hierarchical cache makes it wait for host→device loads."""

    def tier_stats(self) -> dict:
        return {}

    @property
    def host_capacity_pages(self) -> int:
        """Pages the host tier holds at most (none without one)."""
        return 0

    def close(self) -> None:
        """Release threads and connections (a hierarchical cache flushes its pending storage writes)."""

    def evictable_pages(self) -> int:
        return self.allocator.num_cache_only

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unreferenced pages, least recently used leaves first. Returns pages freed."""
        freed = 0
        while freed < num_pages:
            node = self._pop_lru_candidate()
            if node is None:
                break
            parent = node.parent
            del parent.children[node.key]
            self.allocator.free([self._detach_page(node)])
            self.num_pages -= 1
            freed += 1
            self._push_candidate(parent)
        return freed

    def reset(self) -> None:
        """Drop every cached page (the caller ensures no request is running)."""
        self.allocator.free([self._detach_page(n) for n in self._nodes()])
        self.root.children.clear()
        self.num_pages = 0
        self._candidates.clear()

    # ---- device pages of nodes, and the eviction candidates ---------------------------------------------------

    def _attach_page(self, node: _Node, page: int) -> None:
        """`page` (whose reference the tree has just taken) now holds node's tokens on the device."""
        node.page = page
        self._node_of_page[page] = node
        self.allocator.mark_cached(page)

    def _detach_page(self, node: _Node) -> int:
        """Node's device page leaves the tree; the caller frees the tree's reference."""
        page, node.page = node.page, -1
        self.allocator.unmark_cached(page)
        del self._node_of_page[page]
        return page

    def _on_cache_only(self, page: int) -> None:
        self._push_candidate(self._node_of_page[page])

    def _push_candidate(self, node: _Node) -> None:
        if node is self.root or not self._evictable_leaf(node):
            return
        if len(self._candidates) > 2 * self.num_pages + 64:  # mostly stale entries: rebuild from the tree
            self._candidates = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
            heapq.heapify(self._candidates)
        else:
            heapq.heappush(self._candidates, (node.last_access, id(node), node))

    def _pop_lru_candidate(self) -> _Node | None:
        """The least recently used evictable leaf, or None when there is none."""
        while self._candidates:
            access, _, node = heapq.heappop(self._candidates)
            if not self._evictable_leaf(node):
                continue  # evicted, referenced again or no longer a leaf: pushed again when it qualifies
            if access != node.last_access:
                heapq.heappush(self._candidates, (node.last_access, id(node), node))  # touched since
                continue
            return node
        return None

    def _evictable_leaf(self, node: _Node) -> bool:
        """Node's device page is in the tree, nobody else references it, and no child has a device page."""
        return node.page >= 0 and self._unused(node) and all(c.page < 0 for c in node.children.values())

    def _unused(self, node: _Node) -> bool:
        return self.allocator.refcount(node.page) == 1

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
