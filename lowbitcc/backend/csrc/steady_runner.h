// ExactRunner: a CPU reduction that runs as its place's exact entry, served in C++ from the
// group's own Python objects (lowbitcc/backend/steady_runner.py builds it).
//
// `serve_all_reduce` and `serve_reduce_scatter` are what `LocoProcessGroup`'s methods call
// first. Each either serves the call whole or answers None ("not mine") having changed nothing,
// and the Python path (reductions.py) then takes the call as it always does. A call is served
// when it is the steady state of `CallSchedule.take` and `Reductions._run_exact` for a native op
// (the inner gloo group runs it itself): one dense CPU torch.Tensor, issued by the main thread
// outside any future's callback, no `compressed()` or `feedback_key` block in force, no
// outcome open in the schedule, the period known, the place's entry exact with runs left, its
// canary not NaN, its key the call's, its renewal not due to start at this run (the Python
// path starts it), not timed for the cost model (this run, and the issuer's one in
// `EXACT_TIMED`, are the Python path's). Serving does, on the same objects and in the same
// order, what those Python methods do: the schedule's index and the entry's runs, the call
// number (`CallAgreement.next_seq`), the feedback key's ordinal where this rank would compress
// the call (`CompressedCalls._ordinal`), the cost model's count, the statistics
// (`exact.count_exact`), the issuer's count of exact calls, the call's tag
// (`IssueQueue._next_tag`), the inner gloo call (the GIL released), its `FollowedWork`, kept as
// the place's canary (an all-reduce).
//
// Threads: the caller holds the GIL; every Python object is read and written under it, the
// statistics', cost model's and ordinals' locks taken as their Python owners take them. Only the
// gloo call runs without the GIL.
#pragma once

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "followed_work.h"

namespace lowbitcc {

namespace detail {

// `obj.name += delta` for a Python number attribute.
inline void add_to(py::handle obj, const char* name, py::handle delta) {
  py::object now = obj.attr(name);
  py::object sum = py::reinterpret_steal<py::object>(PyNumber_Add(now.ptr(), delta.ptr()));
  if (!sum) {
    throw py::error_already_set();
  }
  obj.attr(name) = sum;
}

// `a == b` in Python.
inline bool equal(py::handle a, py::handle b) {
  int result = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (result < 0) {
    throw py::error_already_set();
  }
  return result == 1;
}

// Holds a Python `threading.Lock` for a scope (its acquire waits without the GIL).
class Held {
 public:
  explicit Held(py::object lock) : lock_(std::move(lock)) { lock_.attr("acquire")(); }
  ~Held() {
    try {
      lock_.attr("release")();
    } catch (...) {
    }
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  py::object lock_;
};

}  // namespace detail

class __attribute__((visibility("hidden"))) ExactRunner {
 public:
  // `objects`: a dict of the group's Python objects and settings (steady_runner.py's
  // `runner_objects` names and describes each).
  ExactRunner(c10::intrusive_ptr<c10d::Backend> direct, py::dict objects)
      : direct_(std::move(direct)),
        schedule_(objects["schedule"]),
        compressed_(objects["compressed"]),
        agreement_(objects["agreement"]),
        issuer_(objects["issuer"]),
        queue_(objects["queue"]),
        followed_(objects["followed"]),
        state_(objects["state"]),
        logical_bytes_(objects["logical_bytes"]),
        mode_stack_(objects["mode_stack"]),
        key_stack_(objects["key_stack"]),
        callback_context_(objects["callback_context"]),
        tensor_type_(objects["tensor_type"]),
        allreduce_options_type_(objects["allreduce_options_type"]),
        reduce_scatter_options_type_(objects["reduce_scatter_options_type"]),
        policy_(objects["policy"].cast<std::string>()),
        main_thread_(objects["main_thread"].cast<uint64_t>()),
        world_(objects["world"].cast<int64_t>()),
        min_size_(objects["min_size"].cast<int64_t>()),
        timed_every_(objects["timed_every"].cast<int64_t>()),
        issuer_counts_(objects["issuer_counts"].cast<bool>()) {
    for (auto op : objects["native_ops"]) {
      native_ops_.insert(op.cast<int64_t>());
    }
    all_reduce_ = py::str("all_reduce");
    reduce_scatter_ = py::str("reduce_scatter");
    cpu_ = py::str("cpu");
    backward_ = py::str("backward");
    exact_ = py::str("exact");
  }

  // A test switch: decline a call that could be served with probability `p` (a generator
  // seeded with `seed`), so that ranks take either path at random per call.
  void decline_at_random(double p, uint64_t seed) {
    decline_ = p;
    rng_.seed(seed);
  }

  // Calls served since the runner was made (tests read it).
  int64_t served() const { return served_; }

  // `LocoProcessGroup.allreduce(tensors, opts)`: its Work, or None (not served).
  py::object serve_all_reduce(py::handle tensors, py::handle opts) {
    if (!PyList_Check(tensors.ptr()) || PyList_GET_SIZE(tensors.ptr()) != 1) {
      return py::none();
    }
    c10d::AllreduceOptions options;
    if (!opts.is_none()) {
      if (Py_TYPE(opts.ptr()) != reinterpret_cast<PyTypeObject*>(allreduce_options_type_.ptr())) {
        return py::none();
      }
      options = opts.cast<c10d::AllreduceOptions>();
    }
    py::handle item = PyList_GET_ITEM(tensors.ptr(), 0);
    if (!plain_cpu(item)) {
      return py::none();
    }
    at::Tensor tensor = THPVariable_Unpack(item.ptr());
    Steady steady;
    if (!steady_place(all_reduce_, tensor, tensor.numel(), options.reduceOp.op_, steady)) {
      return py::none();
    }
    count(steady, all_reduce_, tensor, tensor.numel());
    std::vector<at::Tensor> inputs{tensor};
    c10::intrusive_ptr<c10d::Work> work;
    {
      py::gil_scoped_release release;
      work = direct_->allreduce(inputs, options);
    }
    py::object followed = follow(work, tensor);
    // `Entry.keep`: the place's next run reads the canary of the run before this one
    steady.entry.attr("canary") = steady.entry.attr("latest");
    steady.entry.attr("latest") = followed;
    return followed;
  }

  // `LocoProcessGroup.reduce_scatter_single(output, input, opts)`: its Work, or None.
  py::object serve_reduce_scatter(py::handle output_obj, py::handle input_obj, py::handle opts) {
    c10d::ReduceScatterOptions options;
    if (!opts.is_none()) {
      if (Py_TYPE(opts.ptr()) !=
          reinterpret_cast<PyTypeObject*>(reduce_scatter_options_type_.ptr())) {
        return py::none();
      }
      options = opts.cast<c10d::ReduceScatterOptions>();
    }
    if (!plain_cpu(input_obj) || Py_TYPE(output_obj.ptr()) != Py_TYPE(input_obj.ptr())) {
      return py::none();
    }
    at::Tensor input = THPVariable_Unpack(input_obj.ptr());
    at::Tensor output = THPVariable_Unpack(output_obj.ptr());
    if (output.numel() * world_ != input.numel() || output.scalar_type() != input.scalar_type()) {
      return py::none();
    }
    Steady steady;
    if (!steady_place(reduce_scatter_, input, input.numel(), options.reduceOp.op_, steady)) {
      return py::none();
    }
    count(steady, reduce_scatter_, input, input.numel());
    c10::intrusive_ptr<c10d::Work> work;
    {
      py::gil_scoped_release release;
      work = direct_->_reduce_scatter_base(output, input, options);
    }
    return follow(work, output);
  }

 private:
  // What `steady_place` found: the entry, and what its run counts.
  struct Steady {
    py::object entry;
    int64_t index = 0;
    int64_t left = 0;
    bool ordinal = false;
    bool modelled = false;
    bool by_model = false;
    int64_t task = -1;
  };

  // A plain (not a subclass) dense CPU torch.Tensor.
  bool plain_cpu(py::handle obj) const {
    if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(tensor_type_.ptr())) {
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    return t.layout() == at::kStrided && t.device().is_cpu();
  }

  // Whether the call runs as its place's exact entry now, nothing changed yet (see the file's
  // comment); fills `steady`.
  bool steady_place(const py::str& collective, const at::Tensor& like, int64_t numel,
                    c10d::ReduceOp::RedOpType op, Steady& steady) {
    try {
      return steady_place_or_raise(collective, like, numel, op, steady);
    } catch (py::error_already_set&) {  // nothing changed: the Python path raises as it does
      return false;
    } catch (const std::exception&) {
      return false;
    }
  }

  bool steady_place_or_raise(const py::str& collective, const at::Tensor& like, int64_t numel,
                             c10d::ReduceOp::RedOpType op, Steady& steady) {
    if (native_ops_.count(static_cast<int64_t>(op)) == 0) {
      return false;
    }
    if (PyThread_get_thread_ident() != main_thread_ ||
        py::bool_(callback_context_.attr("parent"))) {  // (a tag: 64 bits, unsigned)
      return false;
    }
    if (py::cast<int64_t>(schedule_.attr("_open")) != 0) {
      return false;
    }
    py::object period_obj = schedule_.attr("_period");
    if (period_obj.is_none()) {
      return false;
    }
    int64_t period = period_obj.cast<int64_t>();
    if (period <= 0) {
      return false;
    }
    int64_t origin = schedule_.attr("_origin").cast<int64_t>();
    int64_t index = schedule_.attr("_next").cast<int64_t>();
    int64_t offset = (index - origin) % period;
    if (offset < 0) {
      offset += period;
    }
    py::object entries = schedule_.attr("_entries");
    PyObject* found = PyDict_GetItemWithError(entries.ptr(), py::int_(origin + offset).ptr());
    if (found == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      return false;
    }
    py::object entry = py::reinterpret_borrow<py::object>(found);
    if (!entry.attr("exact").cast<bool>() || entry.attr("timed").cast<bool>()) {
      return false;
    }
    int64_t left = entry.attr("left").cast<int64_t>();
    if (left <= 0) {
      return false;
    }
    if (nan(entry.attr("canary"))) {  // (may wait without the GIL: the policy is read after)
      return false;
    }
    if (PyList_GET_SIZE(key_stack_.ptr()) != 0) {  // `explicit_key` counts its block's calls
      return false;
    }
    Py_ssize_t modes = PyList_GET_SIZE(mode_stack_.ptr());
    std::string mode =
        modes ? py::cast<std::string>(PyList_GET_ITEM(mode_stack_.ptr(), modes - 1)) : policy_;
    if (mode == "always") {  // a `compressed()` block: the wish and the cost model's consent
      return false;
    }
    if (left - 1 <= schedule_.attr("_renew_at").cast<int64_t>() &&
        entry.attr("renewal").is_none() && !schedule_.attr("_renew").is_none() &&
        !entry.attr("desc").attr("part").cast<bool>()) {
      return false;  // `CallSchedule.ran` starts the renewal
    }
    py::tuple key = entry.attr("key");
    if (key.size() != 6 || !detail::equal(key[0], collective) ||
        key[1].ptr() != reinterpret_cast<PyObject*>(torch::getTHPDtype(like.scalar_type())) ||
        key[2].cast<int64_t>() != static_cast<int64_t>(op) || key[3].cast<int64_t>() != numel ||
        key[4].cast<bool>() || py::bool_(key[5])) {  // (a parent's tag: 64 bits, unsigned)
      return false;  // a deviation: the Python path runs it
    }
    // `CompressedCalls.count_planned`: the ordinal where this rank would compress the call
    // (`policy.wants_compression`), counted in the backward pass's epoch (`policy.epoch`)
    int64_t task = torch::autograd::get_current_graph_task_id();
    bool wants = mode == "auto" || (mode != "never" && task >= 0);
    steady.ordinal = entry.attr("eligible").cast<bool>() && policy_ != "never" && wants;
    if (steady.ordinal && task < 0) {
      return false;  // the step's epoch: `policy.epoch` reads the optimizer's steps
    }
    steady.task = task;
    steady.modelled = compressed_.attr("_modelling").cast<bool>() && numel >= min_size_;
    if (steady.modelled && issuer_counts_ && timed_every_ > 0 &&
        (issuer_.attr("_issued").cast<int64_t>() + 1) % timed_every_ == 0) {
      return false;  // `WorkerIssuer.native_now` times this one
    }
    if (decline_ > 0.0 && std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < decline_) {
      return false;
    }
    steady.by_model = steady.modelled && entry.attr("by_model").cast<bool>();
    steady.entry = std::move(entry);
    steady.index = index;
    steady.left = left;
    return true;
  }

  // The place's canary: whether the output it views ended in NaN (`Entry.canary`, None: no).
  static bool nan(const py::object& canary) {
    if (canary.is_none()) {
      return false;
    }
    if (py::isinstance<FollowedWork>(canary)) {
      FollowedWork& work = canary.cast<FollowedWork&>();
      if (work.isCompleted()) {  // the steady state: its run after next reads it
        return work.nan();
      }
      py::gil_scoped_release release;
      return work.nan();
    }
    return canary.attr("nan")().cast<bool>();
  }

  // What the Python path counts for the run (`CallSchedule.take`, `ran`;
  // `Reductions._run_exact`; `count_planned`; `count_exact`; `WorkerIssuer._times_next`).
  void count(const Steady& steady, const py::str& collective, const at::Tensor& like,
             int64_t numel) {
    schedule_.attr("_next") = py::int_(steady.index + 1);
    steady.entry.attr("left") = py::int_(steady.left - 1);
    agreement_.attr("next_seq")();
    py::object dtype =
        py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(
            like.scalar_type())));
    if (steady.ordinal) {
      py::tuple epoch = py::make_tuple(backward_, steady.task);
      detail::Held held(compressed_.attr("_lock"));
      if (!detail::equal(epoch, compressed_.attr("_epoch"))) {
        compressed_.attr("_epoch") = epoch;
        compressed_.attr("_ordinals").attr("clear")();
      }
      py::dict ordinals = compressed_.attr("_ordinals");
      py::tuple signature = py::make_tuple(collective, dtype, numel);
      int64_t ordinal = ordinals.contains(signature) ? ordinals[signature].cast<int64_t>() : 0;
      ordinals[signature] = py::int_(ordinal + 1);
    }
    int64_t nbytes = numel * static_cast<int64_t>(like.element_size());
    if (steady.modelled) {
      int64_t log2 = 63 - __builtin_clzll(static_cast<uint64_t>(std::max<int64_t>(nbytes, 1)));
      py::tuple size_class = py::make_tuple(collective, cpu_, log2);
      py::object model = compressed_.attr("cost_model");
      detail::Held held(model.attr("_lock"));
      py::object kept = model.attr("_classes").attr("get")(size_class);
      if (kept.is_none()) {
        kept = model.attr("_class")(size_class);
      }
      detail::add_to(kept, "calls", py::int_(1));
      if (issuer_counts_) {
        detail::add_to(issuer_, "_issued", py::int_(1));
      }
    }
    py::object sent = logical_bytes_(collective, nbytes, world_);
    {
      py::object stats = state_.attr("STATS");  // `count_exact` reads it at each call
      detail::Held held(stats.attr("_lock"));
      py::object counters = stats.attr("_counters")[exact_];
      detail::add_to(counters, "calls", py::int_(1));
      detail::add_to(counters, "tensor_bytes", py::int_(nbytes));
      detail::add_to(counters, "logical_bytes", sent);
      detail::add_to(counters, "wire_bytes", sent);
      detail::add_to(counters, "model_exact", py::int_(steady.by_model ? 1 : 0));
    }
    ++served_;
  }

  // `IssueQueue.follow`: the call's tagged `FollowedWork` (its Python class) over gloo's `work`.
  py::object follow(const c10::intrusive_ptr<c10d::Work>& work, const at::Tensor& output) {
    py::object ordinal = queue_.attr("_issued").attr("__next__")();
    uint64_t tag = queue_.attr("_group_tag").cast<uint64_t>() |
                   (ordinal.cast<uint64_t>() & 0xFFFFFFFFull);
    py::object followed = followed_(work, std::vector<at::Tensor>{output}, tag);
    followed.attr("queue") = queue_;
    return followed;
  }

  c10::intrusive_ptr<c10d::Backend> direct_;
  py::object schedule_, compressed_, agreement_, issuer_, queue_, followed_, state_;
  py::object logical_bytes_, mode_stack_, key_stack_, callback_context_;
  py::object tensor_type_, allreduce_options_type_, reduce_scatter_options_type_;
  std::string policy_;
  uint64_t main_thread_;
  int64_t world_, min_size_, timed_every_;
  bool issuer_counts_;
  std::set<int64_t> native_ops_;
  py::str all_reduce_, reduce_scatter_, cpu_, backward_, exact_;
  double decline_ = 0.0;
  std::mt19937_64 rng_;
  int64_t served_ = 0;
};

}  // namespace lowbitcc
