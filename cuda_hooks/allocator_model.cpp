// The CUDA caching allocator *model*'s replay loop (memadvisor/simulate/allocator.py), in
// C++ for speed: advise replays the allocation stream of every plan it shows, and a
// 5M-event trace makes ~4M allocations per replay (minutes in Python, a fraction of a
// second here).
//
// The semantics are exactly those of allocator.CachingAllocator + allocator.replay (the
// Python stays the reference: tests/simulate/test_allocator_native.py replays random and
// real streams through both and requires identical results).  No torch, no Python API:
// plain C ABI, loaded with ctypes.
//
// The stream comes in as replay_events makes it (signed sizes, row ids): rounding to
// blocks and finding the queries (an allocation freed by the very next event) happen in
// the loop, so no per-event array is made in Python.  Every cost is per event, at most
// logarithmic in the sizes or blocks free at once (never in the stream's length):
// - a pool's free blocks are kept by size: an ordered map of the sizes free now, each with
//   a heap of its blocks by (segment, offset) -- best fit is the first size >= the request
//   and its lowest block, CachingAllocator's (size, segment, offset) order -- and a block
//   leaving a free list only makes its entry stale (dropped when it surfaces);
// - blocks carry their pool and are recycled once merged away;
// - the storages alive are found by row id in a flat table where the ids are dense (they
//   are: replay_events numbers rows), a hash map otherwise;
// - a segment's first block is the one it was created with (a merge keeps the lower
//   block), so segments point at it and no (segment, offset) index is needed.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

namespace {

struct Block {
    int64_t segment, offset, size;
    Block* prev;
    Block* next;
    uint64_t stamp;  // bumped whenever it enters or leaves a free list
    bool free;
    bool small;
};

// A free block's entry in its size's bucket; stale once the block's stamp moved on.
struct Entry {
    int64_t segment, offset;
    Block* block;
    uint64_t stamp;
    // std::push_heap keeps the largest first: the "largest" is the lowest (segment, offset)
    bool operator<(const Entry& o) const {
        if (segment != o.segment) return segment > o.segment;
        return offset > o.offset;
    }
};

// The free blocks of one size: a heap of entries, the lowest (segment, offset) on top,
// entries of blocks that left since dropped lazily (when they surface).
struct Bucket {
    std::vector<Entry> heap;
    int64_t count = 0;  // blocks of this size free now

    Block* top() {
        while (true) {
            const Entry& e = heap.front();
            if (e.block->stamp == e.stamp) return e.block;
            std::pop_heap(heap.begin(), heap.end());
            heap.pop_back();
        }
    }
};

struct Segment {
    int64_t bytes;
    Block* head;
    bool small;
    bool alive;
};

// A pool's free blocks by size: best fit is the first bucket at or above the request, and
// in it the lowest (segment, offset) -- the order of CachingAllocator's (size, segment,
// offset) free list.
using FreeList = std::map<int64_t, Bucket>;

struct Model {
    int64_t min_block, small_size, small_buffer, large_buffer, min_large_alloc, round_large;
    int64_t capacity;
    FreeList free_lists[2];  // [0] large, [1] small
    std::vector<Segment> segments;  // by id, in creation order
    int64_t segments_alive = 0;
    std::vector<Block*> blocks;  // every block made (owned here)
    std::vector<Block*> spare;  // blocks merged away, reused
    int64_t allocated = 0, reserved = 0;
    int64_t peak_allocated = 0, peak_reserved = 0;
    bool out_of_memory = false;

    ~Model() {
        for (Block* b : blocks) delete b;
    }

    int64_t segment_size(int64_t rounded) const {
        if (rounded <= small_size) return small_buffer;
        if (rounded < min_large_alloc) return large_buffer;
        return (rounded + round_large - 1) / round_large * round_large;
    }

    Block* make(int64_t segment, int64_t offset, int64_t size, bool is_free, bool small,
                Block* prev, Block* next) {
        Block* b;
        if (!spare.empty()) {
            b = spare.back();
            spare.pop_back();
        } else {
            b = new Block;
            b->stamp = 0;
            blocks.push_back(b);
        }
        uint64_t stamp = b->stamp;  // never reset: old entries of a reused block stay stale
        *b = Block{segment, offset, size, prev, next, stamp, is_free, small};
        return b;
    }

    void insert_free(Block* b) {
        b->free = true;
        ++b->stamp;
        Bucket& bucket = free_lists[b->small][b->size];
        bucket.heap.push_back(Entry{b->segment, b->offset, b, b->stamp});
        std::push_heap(bucket.heap.begin(), bucket.heap.end());
        ++bucket.count;
    }

    void remove_free(Block* b) {
        FreeList& items = free_lists[b->small];
        auto it = items.find(b->size);
        ++b->stamp;  // its entry is stale now
        if (--it->second.count == 0) items.erase(it);
    }

    // the best-fitting free block of at least ``rounded`` bytes, or null
    Block* best_fit(int64_t rounded, bool small) {
        FreeList& items = free_lists[small];
        auto it = items.lower_bound(rounded);
        return it == items.end() ? nullptr : it->second.top();
    }

    void release_free_segments() {
        for (Segment& s : segments) {
            if (!s.alive) continue;
            Block* b = s.head;
            if (b->free && b->size == s.bytes) {
                remove_free(b);
                reserved -= s.bytes;
                s.alive = false;
                --segments_alive;
                spare.push_back(b);
            }
        }
    }

    void new_segment(int64_t nbytes, bool small) {
        if (reserved + nbytes > capacity) {
            release_free_segments();
            if (reserved + nbytes > capacity) out_of_memory = true;
        }
        int64_t segment = static_cast<int64_t>(segments.size());
        Block* b = make(segment, 0, nbytes, true, small, nullptr, nullptr);
        segments.push_back(Segment{nbytes, b, small, true});
        ++segments_alive;
        insert_free(b);
        reserved += nbytes;
        if (reserved > peak_reserved) peak_reserved = reserved;
    }

    bool splits(int64_t remaining, bool small) const {
        return small ? remaining >= min_block : remaining > small_size;
    }

    Block* malloc_rounded(int64_t rounded, bool small) {
        Block* b = best_fit(rounded, small);
        if (b == nullptr) {
            new_segment(segment_size(rounded), small);
            b = best_fit(rounded, small);
        }
        remove_free(b);
        b->free = false;
        int64_t remaining = b->size - rounded;
        if (splits(remaining, small)) {
            Block* rest = make(b->segment, b->offset + rounded, remaining, true, small, b,
                               b->next);
            if (b->next) b->next->prev = rest;
            b->next = rest;
            b->size = rounded;
            insert_free(rest);
        }
        allocated += b->size;
        if (allocated > peak_allocated) peak_allocated = allocated;
        return b;
    }

    void free_block(Block* b) {
        allocated -= b->size;
        Block* before = b->prev;
        Block* after = b->next;
        if (before != nullptr && before->free) {
            remove_free(before);
            before->size += b->size;
            before->next = b->next;
            if (b->next) b->next->prev = before;
            spare.push_back(b);
            b = before;
        }
        if (after != nullptr && after->free) {
            remove_free(after);
            b->size += after->size;
            b->next = after->next;
            if (after->next) after->next->prev = b;
            spare.push_back(after);
        }
        insert_free(b);
    }

    // A query: an allocation freed by the very next event.  When a cached block can hold
    // it, splitting and merging back leave the allocator exactly as it was: only its bytes
    // count toward the allocated peak.  Returns false when it needs a new segment.
    bool query(int64_t size, bool small) {
        FreeList& items = free_lists[small];
        if (items.empty() || items.rbegin()->first < size) return false;
        if (allocated + items.rbegin()->first > peak_allocated) {
            int64_t block_size = items.lower_bound(size)->first;
            int64_t remaining = block_size - size;
            int64_t taken = splits(remaining, small) ? size : block_size;
            if (allocated + taken > peak_allocated) peak_allocated = allocated + taken;
        }
        return true;
    }
};

// Storages alive by row id: a flat table where ids are dense, a hash map otherwise.
struct DenseLive {
    std::vector<Block*> table;
    explicit DenseLive(int64_t rows) : table(static_cast<size_t>(rows), nullptr) {}
    void put(int64_t row, Block* b) { table[row] = b; }
    Block* take(int64_t row) {
        Block* b = table[row];
        table[row] = nullptr;
        return b;
    }
};

struct SparseLive {
    std::unordered_map<int64_t, Block*> map;
    explicit SparseLive(int64_t events) { map.reserve(static_cast<size_t>(events / 2 + 1)); }
    void put(int64_t row, Block* b) { map[row] = b; }
    Block* take(int64_t row) {
        auto found = map.find(row);
        if (found == map.end()) return nullptr;
        Block* b = found->second;
        map.erase(found);
        return b;
    }
};

int64_t rounded_size(double signed_size, int64_t min_block) {
    // np.abs(x).round().astype(int64): round half to even, as rint in the default mode
    int64_t magnitude = static_cast<int64_t>(std::nearbyint(std::fabs(signed_size)));
    int64_t rounded = (magnitude + (min_block - 1)) & -min_block;
    return rounded < min_block ? min_block : rounded;
}

template <class Live>
bool run(Model& m, Live& live, int64_t n, const double* sizes, const int64_t* rows,
         int64_t stop_above) {
    for (int64_t i = 0; i < n; ++i) {
        const double s = sizes[i];
        const int64_t row = rows[i];
        if (!(s > 0)) {  // a free (a size of 0 counts as one, as in allocator.replay)
            Block* b = live.take(row);
            if (b != nullptr) m.free_block(b);
            continue;
        }
        const int64_t size = rounded_size(s, m.min_block);
        const bool small = size <= m.small_size;
        if (i + 1 < n && !(sizes[i + 1] > 0) && rows[i + 1] == row) {
            ++i;  // the free that follows is part of the query
            if (m.query(size, small)) continue;
            m.free_block(m.malloc_rounded(size, small));
        } else {
            live.put(row, m.malloc_rounded(size, small));
        }
        if (stop_above && m.reserved > stop_above) return false;
    }
    return true;
}

}  // namespace

extern "C" {

int memadvisor_allocator_model_api() { return 2; }

// sizes: signed sizes in bytes (> 0 an allocation, else a free), as replay_events gives
// them; rows: storage id of each event.  constants: min_block (a power of two),
// small_size, small_buffer, large_buffer, min_large_alloc, round_large.
// out: peak_allocated, peak_reserved, segments, out_of_memory, complete.
void memadvisor_allocator_replay(int64_t n, const double* sizes, const int64_t* rows,
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
    int64_t low = 0, high = -1;
    for (int64_t i = 0; i < n; ++i) {
        if (rows[i] < low) low = rows[i];
        if (rows[i] > high) high = rows[i];
    }
    bool complete;
    if (low >= 0 && high < 4 * n + 1024) {
        DenseLive live(high + 1);
        complete = run(m, live, n, sizes, rows, stop_above);
    } else {
        SparseLive live(n);
        complete = run(m, live, n, sizes, rows, stop_above);
    }
    out[0] = m.peak_allocated;
    out[1] = m.peak_reserved;
    out[2] = m.segments_alive;
    out[3] = m.out_of_memory ? 1 : 0;
    out[4] = complete ? 1 : 0;
}

}  // extern "C"
