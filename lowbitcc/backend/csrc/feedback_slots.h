// FeedbackSlots: the error states of a plan core's runs (lowbitcc/backend/plan_cores.py, "Error
// feedback"), one slot per encode of a run, each keyed as `CallCompressor.encode` keys it: the
// call's key and `|stage`, the encode's. The call's key is derived from its position (the
// plan's `prefix`, then the call's ordinal: its layout tracked by the storage the call reduces)
// or named by a `feedback_key` block (`named_prefix`, then the name: not tracked).
//
// `take`, before a run: each slot's state out of the plan's `feedback.FeedbackStore`, as its
// `take` hands it over. A steady state (kept under the key, a tracked key's buffer the call's
// storage, its size, storage and group size the encode's, on the CPU) is taken here, on the
// store's own containers under its lock: popped from `_states` (a tracked key's layout counted as
// `FeedbackStore._replaced` counts it: the same buffer, or another where the key's buffers are
// known to be transient, a new one at every use; and made the most recent), applied unless
// `reset_interval` uses are reached or the run that stored it dropped it (its
// `ErrorState.run_verdict`, `feedback._void`; both drop it: the encode then writes it anew from
// zero, as it writes a new state). Any other key (a first use, a persistent buffer replaced, a
// loaded state, a state whose run is still decoding) goes through the store's own `take`
// (`plan_cores.take_state`, which waits for that run). The keys are taken one by one in the
// order the run's encodes will run, as the Python path takes them (the order of the store's
// layouts, its least recently used first, is the Python path's).
// `put`, once the run's encodes are done (core_issue.h's `end_encodes`): each state back under its key in the
// order the encodes ran, one use more, with the run's verdict (`TakenStates::verdict`, which
// the core gives once the run is done: dropped where its decodes then met a non-finite value or
// a foreign message, or a transfer failed), the store bounded to its `max_keys` (its own
// `_bound`); none where an encode of the run met a non-finite value (dropped, as
// `CallCompressor.finish` drops them); a state whose encode did not run (the run failed
// before it) back as it was taken, where it was applied.
//
// Threads: `take` and `put` with the GIL held, on the thread that runs the run's encodes (the
// calling thread, or a whole run's on the group's issue lane: issue_lane.h); the encodes read the
// slots' tensors without it, between the two.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "codec_api.h"
#include "python_objects.h"

namespace lowbitcc {

// One encode's error state for one run: its key, the `ErrorState`, its data (and an int8
// state's scales), its uses before the run, and whether the encode applies it (else it writes
// it from zero).
struct __attribute__((visibility("hidden"))) Slot {
  py::object key, state;
  at::Tensor data, scales;
  int64_t uses = 0;
  bool applied = false;
};

// A run's verdict on the error states it stored before its last decodes (`ErrorState.run_verdict`
// in Python): given once, by the run's end (`give`), and read by the store's takes (`dropped`,
// which waits for it, the GIL released by its binding).
class __attribute__((visibility("hidden"))) RunVerdict {
 public:
  // The run is done; `dropped`: its states count as dropped. Only the first call counts.
  void give(bool dropped) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done_) {
        return;
      }
      done_ = true;
      dropped_ = dropped;
    }
    given_.notify_all();
  }
  bool done() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  // Whether the run's states count as dropped, once it is done.
  bool dropped() {
    std::unique_lock<std::mutex> lock(mutex_);
    given_.wait(lock, [this] { return done_; });
    return dropped_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable given_;
  bool done_ = false, dropped_ = false;
};

// What one run takes and puts back: its slots, how many of its encodes ran (always the first of
// the run's encode order: a run that fails stops encoding), whether one met a non-finite value,
// and its verdict.
struct __attribute__((visibility("hidden"))) TakenStates {
  std::vector<Slot> slots;
  size_t encoded = 0;
  bool encoded_nonfinite = false;
  std::shared_ptr<RunVerdict> verdict;
};

// The key a run takes its states under: `derived` or `named` (`FeedbackSlots`), and whether it is
// tracked (derived).
struct __attribute__((visibility("hidden"))) FeedbackKey {
  std::string call;
  bool tracked = false;
};

class __attribute__((visibility("hidden"))) FeedbackSlots {
 public:
  // `feedback`: plan_cores.py's `_feedback` (its docstring names each entry); `group_size`:
  // the codec's.
  FeedbackSlots(const py::dict& feedback, int64_t group_size)
      : store_(feedback["store"]),
        error_dtype_(feedback["error_dtype"]),
        take_(feedback["take"]),
        prefix_(feedback["prefix"].cast<std::string>()),
        named_prefix_(feedback["named_prefix"].cast<std::string>()),
        mode_(feedback["mode"].cast<int32_t>()),
        reset_interval_(feedback["reset_interval"].cast<int64_t>()),
        group_size_(group_size) {
    TORCH_CHECK(mode_ == loco::kErrorInt8 || mode_ == loco::kErrorFp32 ||
                    mode_ == loco::kErrorBf16,
                "lowbitcc: a plan core's error storage ", mode_, " is not one the codec knows");
  }

  // A slot for an encode of stage `stage` whose state holds `numel` elements; its index.
  size_t add(std::string stage, int64_t numel) {
    TORCH_CHECK(numel > 0 && numel % group_size_ == 0,
                "lowbitcc: an error state of whole groups of ", group_size_);
    stages_.push_back(std::move(stage));
    numels_.push_back(numel);
    return stages_.size() - 1;
  }

  int32_t mode() const { return mode_; }

  // The order a run's encodes run in (every slot's index once: the core's schedule's order).
  void set_order(std::vector<size_t> order) {
    std::vector<size_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    bool every = sorted.size() == stages_.size();
    for (size_t i = 0; every && i < sorted.size(); ++i) {
      every = sorted[i] == i;
    }
    TORCH_CHECK(every, "lowbitcc: a plan core's encode order names each encode once");
    order_ = std::move(order);
  }

  // Whether slot `slot` is the `n`th in the encode order.
  bool in_order(size_t n, size_t slot) const { return n < order_.size() && order_[n] == slot; }

  // A derived key, of a call of ordinal `ordinal` (see the file's comment).
  std::string derived(int64_t ordinal) const { return prefix_ + std::to_string(ordinal); }
  // A named key, of a call in a `feedback_key` block whose next key is `name`.
  std::string named(const std::string& name) const { return named_prefix_ + name; }

  // Each slot's state for a call under key `call` (`derived` or `named`; `tracked`: derived)
  // reducing `source` (see the file's comment), into `taken`; the run's verdict made.
  void take(const std::string& call, bool tracked, const at::Tensor& source,
            TakenStates& taken) {
    const std::vector<py::object>& keys = keys_for(call);
    const auto storage = tracked ? reinterpret_cast<intptr_t>(
                                       source.storage().unsafeGetStorageImpl())
                                 : 0;
    TORCH_CHECK(order_.size() == keys.size(), "lowbitcc: a plan core's encode order is set");
    taken.slots.assign(keys.size(), Slot());
    taken.encoded = 0;
    taken.encoded_nonfinite = false;
    py::object states, layouts, tensor = py::none();
    std::optional<detail::Held> held;  // the store's lock, over the keys taken here
    for (size_t i : order_) {
      Slot& slot = taken.slots[i];
      slot.key = keys[i];
      if (!held) {  // (its containers read under it: `load_state_dict` replaces them)
        held.emplace(store_.attr("_lock"));
        states = store_.attr("_states");
        layouts = tracked ? store_.attr("_layouts") : py::object();
      }
      if (take_kept(states, layouts, numels_[i], source, storage, slot)) {
        continue;
      }
      held.reset();  // (the store's own take takes it)
      if (tracked && tensor.is_none()) {
        tensor = py::cast(source);
      }
      py::tuple got = take_(store_, keys[i], numels_[i], error_dtype_, reset_interval_,
                            group_size_, tensor);
      slot.state = got[0];
      slot.uses = got[1].cast<int64_t>();
      slot.applied = got[2].cast<bool>();
    }
    held.reset();
    for (size_t i = 0; i < keys.size(); ++i) {
      bind(taken.slots[i], numels_[i]);
    }
    taken.verdict = std::make_shared<RunVerdict>();
  }

  // Every slot's state of a run back in the store (see the file's comment).
  void put(TakenStates& taken) {
    py::object verdict = py::cast(taken.verdict);
    py::object none = py::none();
    detail::Held held(store_.attr("_lock"));
    py::object states = store_.attr("_states");
    py::object pop = states.attr("pop");
    auto store = [&](Slot& slot, int64_t uses, const py::object& by) {
      pop(slot.key, none);
      slot.state.attr("run_verdict") = by;
      if (PyObject_SetItem(states.ptr(), slot.key.ptr(),
                           py::make_tuple(slot.state, uses).ptr()) < 0) {
        throw py::error_already_set();
      }
    };
    for (size_t n = 0; n < order_.size(); ++n) {
      Slot& slot = taken.slots[order_[n]];
      if (n >= taken.encoded) {  // (its encode did not run)
        if (slot.applied) {
          store(slot, slot.uses, none);
        }
      } else if (taken.encoded_nonfinite) {
        pop(slot.key, none);
      } else {
        store(slot, slot.uses + 1, verdict);
      }
    }
    if (PyObject_Length(states.ptr()) > store_.attr("max_keys").cast<Py_ssize_t>()) {
      store_.attr("_bound")(states);
    }
  }

 private:
  // The slots' keys of a call under key `call`, one per slot (made once per key: a steady
  // place's key stays the same).
  const std::vector<py::object>& keys_for(const std::string& call) {
    if (call != call_ || keys_.size() != stages_.size()) {
      keys_.clear();
      for (const std::string& stage : stages_) {
        keys_.push_back(py::str(call + "|" + stage));
      }
      call_ = call;
    }
    return keys_;
  }

  // The steady case of `FeedbackStore.take` for `slot.key` (see the file's comment), the store's
  // lock held (`layouts`: the store's, for a tracked key whose call reduces `storage`; null: a
  // named key's): false, having changed nothing, where it is not that case.
  bool take_kept(const py::object& states, const py::object& layouts, int64_t numel,
                 const at::Tensor& source, intptr_t storage, Slot& slot) {
    bool same_buffer = true;
    PyObject* entry = detail::item(states, slot.key);
    if (entry == nullptr) {
      return false;
    }
    py::object layout;
    if (layouts) {
      PyObject* found = detail::item(layouts, slot.key);
      if (found == nullptr) {
        return false;
      }
      layout = py::reinterpret_borrow<py::object>(found);
      py::object buffer = layout.attr("buffer");
      if (buffer.is_none()) {
        return false;
      }
      same_buffer = buffer.attr("cdata").cast<intptr_t>() == storage;
      if (!same_buffer && layout.attr("streak").cast<int64_t>() >= 0) {
        return false;  // a persistent buffer replaced: the state goes (the store's own take)
      }
    }
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
      return false;
    }
    py::object state = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 0));
    const int64_t uses = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 1))
                             .cast<int64_t>();
    py::object by = state.attr("run_verdict");
    at::Tensor data = state.attr("data").cast<at::Tensor>();
    if (data.numel() != numel || !data.device().is_cpu() ||
        !detail::equal(state.attr("dtype"), error_dtype_) ||
        state.attr("group_size").cast<int64_t>() != group_size_ ||
        !state.attr("poison").is_none()) {  // (a device call's word: the store's own take)
      return false;
    }
    RunVerdict* verdict = by.is_none() ? nullptr : &by.cast<RunVerdict&>();
    if (verdict != nullptr && !verdict->done()) {
      return false;  // its run is still decoding: the store's own take waits for it
    }
    bool dropped = reset_interval_ > 0 && uses >= reset_interval_;
    if (verdict != nullptr) {
      dropped = dropped || verdict->dropped();
      state.attr("run_verdict") = py::none();
    }
    py::object held_state = state;  // (the store's entry, and its reference, go next)
    if (PyObject_DelItem(states.ptr(), slot.key.ptr()) < 0) {
      throw py::error_already_set();
    }
    if (layout) {
      layouts.attr("move_to_end")(slot.key);
      const int64_t streak = layout.attr("streak").cast<int64_t>();
      if (same_buffer) {
        layout.attr("streak") = py::int_(std::max<int64_t>(streak, 0) + 1);
      } else {  // a transient key's new buffer (streak < 0)
        layout.attr("buffer") = weak_ref(source, layout.attr("buffer"));
        layout.attr("streak") = py::int_(streak - 1);
      }
    }
    slot.state = std::move(held_state);
    slot.uses = dropped ? 0 : uses;
    slot.applied = !dropped;
    return true;
  }

  // A `StorageWeakRef` of `source`'s storage, as `StorageWeakRef(source.untyped_storage())`
  // makes one (a weak reference counted on the storage, let go of by its `_free_weak_ref`,
  // taken from `like`, another one).
  static py::object weak_ref(const at::Tensor& source, const py::object& like) {
    py::object type = py::type::of(like);
    py::object ref = type.attr("__new__")(type);
    c10::StorageImpl* impl = source.storage().unsafeGetStorageImpl();
    ref.attr("_free_weak_ref") = like.attr("_free_weak_ref");
    ref.attr("cdata") = py::int_(reinterpret_cast<intptr_t>(c10::raw::intrusive_ptr::make_weak(impl)));
    return ref;
  }

  // `slot`'s tensors, checked to be what an encode of `numel` elements reads and writes.
  void bind(Slot& slot, int64_t numel) const {
    slot.data = slot.state.attr("data").cast<at::Tensor>();
    const at::ScalarType want = mode_ == loco::kErrorInt8   ? at::kChar
                                : mode_ == loco::kErrorFp32 ? at::kFloat
                                                            : at::kBFloat16;
    bool fit = slot.data.scalar_type() == want && slot.data.numel() == numel &&
               slot.data.is_contiguous() && slot.data.device().is_cpu();
    if (mode_ == loco::kErrorInt8) {
      slot.scales = slot.state.attr("scales").cast<at::Tensor>();
      fit = fit && slot.scales.scalar_type() == at::kFloat &&
            slot.scales.numel() == numel / group_size_ && slot.scales.is_contiguous() &&
            slot.scales.device().is_cpu();
    }
    TORCH_CHECK(fit, "lowbitcc: the error state ", py::cast<std::string>(slot.key),
                " does not fit its encode");
  }

  py::object store_, error_dtype_, take_;
  std::string prefix_, named_prefix_;
  int32_t mode_;
  int64_t reset_interval_, group_size_;
  std::vector<std::string> stages_;
  std::vector<int64_t> numels_;
  std::vector<size_t> order_;
  std::string call_;
  std::vector<py::object> keys_;
};

}  // namespace lowbitcc
