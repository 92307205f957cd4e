// The CUDA caching allocator *model*'s replay loop (memadvisor/simulate/allocator.py), in
// C++ for speed: advise replays the allocation stream of every plan it shows, and a
// 1M-event trace makes ~300k allocations per replay (seconds in Python, milliseconds here).
//
// The semantics are exactly those of allocator.CachingAllocator + allocator.replay (the
// Python stays the reference: tests/simulate/test_allocator_native.py replays random and
// real streams through both and requires identical results).  No torch, no Python API:
// plain C ABI, loaded with ctypes.  Blocks live in a deque (stable addresses); free lists
// are ordered sets of (size, segment, offset, block) - best fit is the first entry >= the
// request (the block pointer never decides an order: the first three are unique).  A
// segment's first block is the one it was created with (a merge keeps the lower block),
// so segments point at it and no (segment, offset) index is needed.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

struct Block {
    int64_t segment, offset, size;
    bool free;
    Block* prev;
    Block* next;
};

using Key = std::tuple<int64_t, int64_t, int64_t, Block*>;  // (size, segment, offset, block)

struct Segment {
    int64_t bytes;
    bool small;
    Block* head;
};

struct Model {
    int64_t min_block, small_size, small_buffer, large_buffer, min_large_alloc, round_large;
    int64_t capacity;
    std::set<Key> free_lists[2];  // [0] large, [1] small
    std::map<int64_t, Segment> segments;  // id -> segment, in creation order
    std::deque<Block> pool;
    int64_t next_segment = 0, allocated = 0, reserved = 0;
    int64_t peak_allocated = 0, peak_reserved = 0;
    bool out_of_memory = false;

    int64_t segment_size(int64_t rounded) const {
        if (rounded <= small_size) return small_buffer;
        if (rounded < min_large_alloc) return large_buffer;
        return (rounded + round_large - 1) / round_large * round_large;
    }

    Block* make(int64_t segment, int64_t offset, int64_t size, bool is_free, Block* prev,
                Block* next) {
        pool.push_back(Block{segment, offset, size, is_free, prev, next});
        return &pool.back();
    }

    void insert_free(Block* b, bool small) {
        b->free = true;
        free_lists[small].insert(Key(b->size, b->segment, b->offset, b));
    }

    void remove_free(Block* b, bool small) {
        free_lists[small].erase(Key(b->size, b->segment, b->offset, b));
    }

    void release_free_segments() {
        for (auto it = segments.begin(); it != segments.end();) {
            Block* b = it->second.head;
            if (b->free && b->size == it->second.bytes) {
                remove_free(b, it->second.small);
                reserved -= it->second.bytes;
                it = segments.erase(it);
            } else {
                ++it;
            }
        }
    }

    void new_segment(int64_t nbytes, bool small) {
        if (reserved + nbytes > capacity) {
            release_free_segments();
            if (reserved + nbytes > capacity) out_of_memory = true;
        }
        int64_t segment = next_segment++;
        Block* b = make(segment, 0, nbytes, true, nullptr, nullptr);
        segments[segment] = Segment{nbytes, small, b};
        insert_free(b, small);
        reserved += nbytes;
        if (reserved > peak_reserved) peak_reserved = reserved;
    }

    bool splits(int64_t remaining, bool small) const {
        return small ? remaining >= min_block : remaining > small_size;
    }

    Block* malloc_rounded(int64_t rounded, bool small) {
        auto& items = free_lists[small];
        auto it = items.lower_bound(Key(rounded, -1, -1, nullptr));
        if (it == items.end()) {
            new_segment(segment_size(rounded), small);
            it = items.lower_bound(Key(rounded, -1, -1, nullptr));
        }
        Block* b = std::get<3>(*it);
        items.erase(it);
        b->free = false;
        int64_t remaining = b->size - rounded;
        if (splits(remaining, small)) {
            Block* rest = make(b->segment, b->offset + rounded, remaining, true, b, b->next);
            if (b->next) b->next->prev = rest;
            b->next = rest;
            b->size = rounded;
            items.insert(Key(remaining, b->segment, rest->offset, rest));
        }
        allocated += b->size;
        if (allocated > peak_allocated) peak_allocated = allocated;
        return b;
    }

    void free_block(Block* b) {
        bool small = segments[b->segment].small;
        allocated -= b->size;
        Block* neighbours[2] = {b->prev, b->next};
        for (Block* n : neighbours) {
            if (n == nullptr || !n->free) continue;
            remove_free(n, small);
            if (n == neighbours[0]) {
                n->size += b->size;
                n->next = b->next;
                if (b->next) b->next->prev = n;
                b = n;
            } else {
                b->size += n->size;
                b->next = n->next;
                if (n->next) n->next->prev = b;
            }
        }
        insert_free(b, small);
    }
};

}  // namespace

extern "C" {

int memadvisor_allocator_model_api() { return 1; }

// kind: 0 free, 1 alloc, 2 alloc freed by the next event (a query); rows: storage id;
// rounded: request rounded to the block size; small: rounded <= the small-pool limit.
// constants: min_block, small_size, small_buffer, large_buffer, min_large_alloc,
// round_large.  out: peak_allocated, peak_reserved, segments, out_of_memory, complete.
void memadvisor_allocator_replay(int64_t n, const int8_t* kind, const int64_t* rows,
                                 const int64_t* rounded, const uint8_t* small,
                                 const int64_t* constants, int64_t capacity,
                                 int64_t stop_above, int64_t* out) {
    Model m;
    m.min_block = constants[0];
    m.small_size = constants[1];
    m.small_buffer = constants[2];
    m.large_buffer = constants[3];
    m.min_large_alloc = constants[4];
    m.round_large = constants[5];
    m.capacity = capacity;
    std::unordered_map<int64_t, Block*> live;
    live.reserve(static_cast<size_t>(n / 2 + 1));
    bool complete = true;
    for (int64_t i = 0; i < n; ++i) {
        const int8_t what = kind[i];
        const int64_t size = rounded[i];
        const bool is_small = small[i] != 0;
        if (what == 0) {
            auto found = live.find(rows[i]);
            if (found != live.end()) {
                Block* b = found->second;
                live.erase(found);
                m.free_block(b);
            }
            continue;
        }
        if (what == 2) {
            auto& items = m.free_lists[is_small];
            if (!items.empty() && std::get<0>(*items.rbegin()) >= size) {
                // best fit, split, free, merge: the free lists end as they began
                if (m.allocated + std::get<0>(*items.rbegin()) > m.peak_allocated) {
                    int64_t block_size =
                        std::get<0>(*items.lower_bound(Key(size, -1, -1, nullptr)));
                    int64_t remaining = block_size - size;
                    int64_t taken = m.splits(remaining, is_small) ? size : block_size;
                    if (m.allocated + taken > m.peak_allocated)
                        m.peak_allocated = m.allocated + taken;
                }
                continue;
            }
            m.free_block(m.malloc_rounded(size, is_small));
        } else {
            live[rows[i]] = m.malloc_rounded(size, is_small);
        }
        if (stop_above && m.reserved > stop_above) {
            complete = false;
            break;
        }
    }
    out[0] = m.peak_allocated;
    out[1] = m.peak_reserved;
    out[2] = static_cast<int64_t>(m.segments.size());
    out[3] = m.out_of_memory ? 1 : 0;
    out[4] = complete ? 1 : 0;
}

}  // extern "C"
