// SteadyRunner: a CPU reduction that runs as its place's entry, served in C++ from the group's
// own Python objects (lowbitcc/backend/steady_runner.py builds it); and the group's exact data
// movements of one tensor and point-to-point calls (runner_moves.h). A CUDA group's *device
// runner* is one too, of CUDA tensors, which serves exact entries and data movements on the
// inner NCCL backend, from any thread but a callback's (runner_device.h; what differs from the
// CPU runner is said where it differs: `own_work_`, `device_type_`, `device_name_`, `canary_`,
// `synced_`, `watchdog_`), and takes the places of compressed entries, whose runs are the Python
// path's (`reductions_`); the rest of this comment is the CPU runner's reductions'.
//
// `serve_all_reduce` and `serve_reduce_scatter` are what `LocoProcessGroup`'s methods call
// first. Each either serves the call whole or answers None ("not mine") having changed nothing,
// and the Python path (reductions.py) then takes the call as it always does. A call is served
// when it is the steady state of `CallSchedule.take` and then of:
//   - `Reductions._run_exact`, for an exact entry and a native op (the inner gloo group runs it
//     itself), timed for the cost model where the worker issuer would time it, one run in
//     `EXACT_TIMED` (model_timings.h; the place's first run after an agreement by the cost
//     model, `Entry.timed`, is the Python path's);
//   - `Reductions._plan_run` and `CallPlan.run`, for a compressed entry whose plan has a C++
//     core (plan_core.h; lowbitcc/backend/plan_cores.py says which plans do), op SUM
//     or AVG, no `exact()` block demanding the exact path of it, once the group's worker has
//     run what was queued before it (its calls on the same gloo group go first:
//     `IssueQueue.wait_idle`, the GIL released, and the place looked at again);
// for one dense CPU torch.Tensor (a reduce-scatter: and its output), issued by the main thread
// outside any future's callback, no `feedback_key` block in force (but around a compressed call,
// which counts in it), no outcome open in the schedule, the period known, the place's entry with
// runs left (or its renewal due to be taken at this run: taken, as `take` takes it,
// and the place looked at again), its canary not NaN, its key the call's. Serving does, on the
// same objects and in the same order, what those Python methods do: the schedule's index and
// the entry's runs (`CallSchedule.ran`, which starts the place's renewal where due: a compressed
// run then waits for the renewal's exchange on the worker), the call number
// (`CallAgreement.next_seq`), the feedback key's ordinal where this rank would compress an exact
// call or compresses one with error feedback (`CompressedCalls._ordinal`; or the name of a
// `feedback_key` block, counted in it: `policy.explicit_key`), the cost model's count, the
// statistics (`exact.count_exact`; a compressed run's `RunTally`: counted in C++,
// served_counts.h, and added to `state.STATS` when it is read), the issuer's count of exact
// calls, the call's tag (`IssueQueue._next_tag`); then the inner gloo call (the GIL released)
// and its `FollowedWork`, kept as the place's canary (an exact all-reduce), or the plan core's
// run, which takes and puts back its error states itself (feedback_slots.h), its Work kept as
// the place's canary where the plan is off the direct schedule (the tree's: a peer's deviation
// shows on some ranks only as NaN, `reductions._keep_canaries`). A plan core's whole run (the
// tree's, the ring's, the hierarchical schedule's, an all-reduce's two phases on more ranks) is
// queued on the group's issue lane (issue_lane.h; the worker issuer's groups have one) and the call
// returns at once; a synchronous call's (c10d's `asyncOp` false, as `dist.all_reduce` without
// `async_op` sets it: its caller waits for the Work at once) runs on the calling thread instead.
//
// Threads: the caller holds the GIL; every Python object is read and written under it, the
// cost model's, ordinals' and feedback store's locks taken as their Python owners take them,
// and the statistics' at the first call after `state.STATS` was replaced (`counted_in`);
// attributes are looked up by interned names (python_objects.h's `LOWBITCC_NAME`). Only the
// gloo call and a plan core's run (encode, then its decode on gloo's thread; a whole run on the
// issue lane, which takes the GIL for its error states and a foreign message's Python check)
// run without it.
//
// Its members are defined by concept: whether a call runs as its place's entry (runner_place.h),
// what a served call counts and leaves (runner_count.h); the serving itself is here.
#pragma once

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

#include "followed_work.h"
#include "point_completer.h"
#include "retired_works.h"
#include "model_timings.h"
#include "plan_core.h"
#include "python_objects.h"
#include "served_counts.h"

namespace lowbitcc {

class __attribute__((visibility("hidden"))) SteadyRunner {
 public:
  // `objects`: a dict of the group's Python objects and settings (steady_runner.py's
  // `runner_objects` names and describes each).
  SteadyRunner(c10::intrusive_ptr<c10d::Backend> direct, py::dict objects)
      : direct_(std::move(direct)),
        inner_(objects["inner"].cast<c10::intrusive_ptr<c10d::Backend>>()),
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
        policy_lock_(objects["policy_lock"]),
        callback_context_(objects["callback_context"]),
        tensor_type_(objects["tensor_type"]),
        allreduce_options_type_(objects["allreduce_options_type"]),
        reduce_scatter_options_type_(objects["reduce_scatter_options_type"]),
        allgather_options_type_(objects["allgather_options_type"]),
        broadcast_options_type_(objects["broadcast_options_type"]),
        alltoall_options_type_(objects["alltoall_options_type"]),
        plan_core_(objects["plan_core"]),
        cpu_device_(objects["cpu_device"]),
        encoder_thread_(objects["encoder_thread"]),
        policy_(objects["policy"].cast<std::string>()),
        main_thread_(objects["main_thread"].cast<uint64_t>()),
        world_(objects["world"].cast<int64_t>()),
        min_size_(objects["min_size"].cast<int64_t>()),
        timed_every_(objects["timed_every"].cast<int64_t>()),
        issuer_counts_(objects["issuer_counts"].cast<bool>()),
        device_name_(objects["device"]),
        device_type_(c10::Device(objects["device"].cast<std::string>()).type()),
        canary_(objects["canary"]),
        reductions_(objects["reductions"]),
        synced_(objects["synced"]),
        watchdog_(objects["watchdog"]),
        own_work_(objects["own_work"].cast<bool>()),
        moves_checked_(objects["moves_checked"].cast<bool>()),
        param_bits_(objects["param_bits"].cast<int64_t>()),
        retired_(objects["retain_s"].cast<double>(), objects["retain_last"].cast<int64_t>()) {
    if (!objects["lane"].is_none()) {
      lane_ = objects["lane"].cast<std::shared_ptr<IssueLane>>();
    }
    for (auto op : objects["native_ops"]) {
      native_ops_.insert(op.cast<int64_t>());
    }
    all_reduce_ = py::str("all_reduce");
    reduce_scatter_ = py::str("reduce_scatter");
    backward_ = py::str("backward");
    step_ = py::str("step");
    compressed_name_ = py::str("compressed");
    counts_object_ = py::cast(counts_);
  }
  SteadyRunner(const SteadyRunner&) = delete;
  SteadyRunner& operator=(const SteadyRunner&) = delete;

  // Destroyed with the GIL held (by its Python object), perhaps with the group's last
  // reference: the gloo group's destructor joins its threads, one of which may be waiting for
  // the GIL (in a Python callback of a call), so the group is let go of without it.
  // What its calls counted and the statistics have not read yet is theirs now, added at their
  // next read (`Stats.hand_over_counts`, which takes no lock: the garbage collector may destroy
  // the runner inside one of the statistics' locks, in the thread that holds it).
  ~SteadyRunner() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      if (counted_in_ && counts_->pending()) {
        try {
          counted_in_.attr(LOWBITCC_NAME("hand_over_counts"))(counts_object_);
        } catch (py::error_already_set& error) {
          error.discard_as_unraisable("lowbitcc: the steady runner's last counts");
        }
      }
      py::gil_scoped_release release;
      direct_.reset();
      inner_.reset();
    }
  }

  // A test switch: decline a call that could be served with probability `p` (a generator
  // seeded with `seed`), so that ranks take either path at random per call.
  void decline_at_random(double p, uint64_t seed) {
    decline_ = p;
    rng_.seed(seed);
  }

  // Whether `decline_at_random`'s switch declines the call now (one draw), where it is on.
  bool declines_at_random() {
    return decline_ > 0.0 && std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < decline_;
  }

  // Hand every finished timing of the runs it served to the cost model now
  // (`ModelTimings::fold`; served calls hand them over in batches): tests read the cost model
  // after their last call.
  void fold_timings() { timings_.fold(compressed_.attr(LOWBITCC_NAME("cost_model")), true); }

  // Calls served since the runner was made, of them compressed ones, and data movements
  // (runner_moves.h; tests read them).
  int64_t served() const { return served_; }
  int64_t served_compressed() const { return served_compressed_; }
  // How many gloo Works of the calls it served it keeps now (`retired_`).
  int64_t kept_works() const { return static_cast<int64_t>(retired_.size()); }
  int64_t served_moves() const { return served_moves_; }
  // What its calls counted in the statistics and they have not read yet (`ServedCounts`).
  py::object counts() const { return counts_object_; }

  // `LocoProcessGroup.allreduce(tensors, opts)`: its Work, or None (not served).
  py::object serve_all_reduce(py::handle tensors, py::handle opts) {
    if (!PyList_Check(tensors.ptr()) || PyList_GET_SIZE(tensors.ptr()) != 1) {
      return py::none();
    }
    c10d::AllreduceOptions options;
    if (!options_of(opts, allreduce_options_type_, options)) {
      return py::none();
    }
    py::handle item = PyList_GET_ITEM(tensors.ptr(), 0);
    if (!plain_on_device(item)) {
      return py::none();
    }
    at::Tensor tensor = THPVariable_Unpack(item.ptr());
    Steady steady;
    if (!steady_place(all_reduce_, tensor, tensor.numel(), options.reduceOp.op_, steady)) {
      return py::none();
    }
    if (steady.core) {
      return serve_planned(steady, all_reduce_, tensor, !options.asyncOp);
    }
    if (steady.python_run) {  // (`LocoProcessGroup.allreduce`'s options and native call)
      py::object given = opts.is_none() ? allreduce_options_type_()
                                        : py::reinterpret_borrow<py::object>(opts);
      return serve_run(steady, all_reduce_, tensor.numel(), item, item,
                       given.attr(LOWBITCC_NAME("reduceOp")),
                       py::make_tuple(LOWBITCC_NAME("allreduce"), py::make_tuple(tensors, given)));
    }
    std::vector<at::Tensor> inputs{tensor};
    if (own_work_) {
      return serve_own(steady, all_reduce_, tensor, item, item,
                       [&] { return direct_->allreduce(inputs, options); });
    }
    count(steady, all_reduce_, tensor, tensor.numel());
    c10::intrusive_ptr<c10d::Work> work;
    const auto issued = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release release;
      work = direct_->allreduce(inputs, options);
    }
    time_exact(steady, work, all_reduce_, tensor, tensor.numel(), issued);
    py::object followed = follow(work, {tensor});
    // `Entry.keep`: the place's next run reads the canary of the run before this one
    steady.entry.attr(LOWBITCC_NAME("canary")) = steady.entry.attr(LOWBITCC_NAME("latest"));
    steady.entry.attr(LOWBITCC_NAME("latest")) = followed;
    return followed;
  }

  // `LocoProcessGroup.reduce_scatter_single(output, input, opts)`: its Work, or None.
  py::object serve_reduce_scatter(py::handle output_obj, py::handle input_obj, py::handle opts) {
    c10d::ReduceScatterOptions options;
    if (!options_of(opts, reduce_scatter_options_type_, options) ||
        !plain_on_device(input_obj) || !plain_on_device(output_obj)) {
      return py::none();
    }
    at::Tensor input = THPVariable_Unpack(input_obj.ptr());
    at::Tensor output = THPVariable_Unpack(output_obj.ptr());
    if (output.numel() * world_ != input.numel() || output.scalar_type() != input.scalar_type()) {
      return py::none();
    }
    Steady steady;
    steady.output = output;
    if (!steady_place(reduce_scatter_, input, input.numel(), options.reduceOp.op_, steady)) {
      return py::none();
    }
    if (steady.core) {
      return serve_planned(steady, reduce_scatter_, input, !options.asyncOp);
    }
    if (steady.python_run) {  // (`reduce_scatter_single_coalesced`'s options and native call)
      py::object given = opts.is_none() ? reduce_scatter_options_type_()
                                        : py::reinterpret_borrow<py::object>(opts);
      return serve_run(steady, reduce_scatter_, input.numel(), input_obj, output_obj,
                       given.attr(LOWBITCC_NAME("reduceOp")),
                       py::make_tuple(LOWBITCC_NAME("_reduce_scatter_base"),
                                      py::make_tuple(output_obj, input_obj, given)));
    }
    if (own_work_) {  // (`Reductions._run_exact` keeps no canary of a reduce-scatter)
      return serve_own(steady, reduce_scatter_, input, output_obj, py::none(),
                       [&] { return direct_->_reduce_scatter_base(output, input, options); });
    }
    count(steady, reduce_scatter_, input, input.numel());
    c10::intrusive_ptr<c10d::Work> work;
    const auto issued = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release release;
      work = direct_->_reduce_scatter_base(output, input, options);
    }
    time_exact(steady, work, reduce_scatter_, input, input.numel(), issued);
    return follow(work, {output});
  }

  // The group's data movements (runner_moves.h): `_allgather_base(output, input, opts)`,
  // `allgather(outputs, inputs, opts)`, `broadcast(tensors, opts)`, `alltoall_base(output,
  // input, output_split_sizes, input_split_sizes, opts)`: their Work, or None.
  py::object serve_all_gather_base(py::handle output, py::handle input, py::handle opts);
  py::object serve_all_gather(py::handle outputs, py::handle inputs, py::handle opts);
  py::object serve_broadcast(py::handle tensors, py::handle opts);
  py::object serve_all_to_all(py::handle output, py::handle input, py::handle output_splits,
                              py::handle input_splits, py::handle opts);
  // Its point-to-point calls (runner_moves.h): `send(tensors, dst, tag)`, `recv(tensors, src,
  // tag)`, `recv_anysource(tensors, tag)`: their Work, or None.
  py::object serve_send(py::handle tensors, py::handle dst, py::handle tag);
  py::object serve_recv(py::handle tensors, py::handle src, py::handle tag);
  py::object serve_recv_anysource(py::handle tensors, py::handle tag);

 private:
  // What `steady_place` found: the entry, and what its run counts.
  struct Steady {
    py::object entry;
    int64_t index = 0;
    int64_t left = 0;
    bool ordinal = false;
    bool modelled = false;
    bool by_model = false;
    bool timed = false;  // an exact run the cost model times (`ModelTimings`)
    int64_t task = -1;
    bool renews = false;  // the run starts the place's renewal
    bool python_run = false;  // a device runner's compressed entry: `Reductions.run` runs it
    std::shared_ptr<PlanCore> core;  // a compressed entry's plan core; null: an exact entry
    at::Tensor output;  // a reduce-scatter's (undefined: an all-reduce's)
  };

  // A call's c10d options: the default where `opts` is None, else `opts` itself where it is of
  // exactly `type` (c10d's; a subclass: the Python path's); false where it is not.
  template <typename Options>
  static bool options_of(py::handle opts, const py::object& type, Options& options) {
    if (opts.is_none()) {
      return true;
    }
    if (Py_TYPE(opts.ptr()) != reinterpret_cast<PyTypeObject*>(type.ptr())) {
      return false;
    }
    options = opts.cast<Options>();
    return true;
  }

  // Whether the calling thread's calls may be served now: a CPU call only from the main thread
  // (`call_entry.takes_place`), none from a future's callback, none once the group's watchdog
  // ended it (`Watchdog.check`: such a group raises at every call, on the Python path).
  bool serves_this_thread() const {
    if ((device_type_ == c10::DeviceType::CPU && PyThread_get_thread_ident() != main_thread_) ||
        py::bool_(callback_context_.attr(LOWBITCC_NAME("parent")))) {  // (a tag: 64 bits)
      return false;
    }
    return watchdog_.is_none() || watchdog_.attr(LOWBITCC_NAME("dead")).is_none();
  }

  // A plain (not a subclass) dense torch.Tensor on the runner's device type.
  bool plain_on_device(py::handle obj) const {
    if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(tensor_type_.ptr())) {
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    return t.layout() == at::kStrided && t.device().type() == device_type_;
  }

  // What a renewal taken here raised (`take_renewal`): the call raises it, as its Python path.
  struct Raised {
    py::error_already_set error;
  };

  // Whether the call runs as its place's entry now, and what that found (runner_place.h).
  bool steady_place(const py::str& collective, const at::Tensor& like, int64_t numel,
                    c10d::ReduceOp::RedOpType op, Steady& steady);
  bool steady_place_or_raise(const py::str& collective, const at::Tensor& like, int64_t numel,
                             c10d::ReduceOp::RedOpType op, Steady& steady, bool waited = false,
                             bool renewed = false);
  bool planned_place(py::object entry, const py::str& collective, const at::Tensor& like,
                     c10d::ReduceOp::RedOpType op, int64_t index, int64_t left, bool forced,
                     bool waited, Steady& steady);
  void take_renewal(int64_t index);
  static bool nan(const py::object& canary);

  // A compressed entry's run (`Reductions._plan_run`, `CallPlan.run`) of `collective` on
  // `tensor` (into `steady.output`: a reduce-scatter): its feedback key's ordinal taken, counted,
  // then the plan core's run (on the issue lane where it runs whole, the group has one and the
  // call is not `synchronous`: c10d's `asyncOp` false), which takes its error states under that
  // key (feedback_slots.h) and puts them back once its encodes are done, and counts the bytes of
  // the transfers it started; its Work.
  py::object serve_planned(Steady& steady, const py::str& collective, const at::Tensor& tensor,
                           bool synchronous);

  // Whether the name of the innermost `feedback_key` block, if any, has a UTF-8 form (the
  // core's keys are built in UTF-8; Python accepts any str, e.g. one with lone surrogates,
  // whose calls are then the Python path's).
  bool named_in_utf8() const;

  // A device runner's exact entry (runner_device.h): counted, `issue` (the inner backend's
  // call) run with the GIL released, its Work handed back as it is (none: `synced_`'s, of
  // `output`), and an all-reduce's canary (`canary_of`: its output; None: a reduce-scatter,
  // which keeps none) kept at the place.
  template <typename Issue>
  py::object serve_own(const Steady& steady, const py::str& collective, const at::Tensor& like,
                       py::handle output, py::handle canary_of, Issue&& issue);
  bool still_at(const Steady& steady);
  // A device runner's compressed entry (runner_device.h): its place taken (the schedule's
  // index and the entry's runs), then `Reductions.run(entry, collective, tensor, output, numel,
  // op, native)`, the Python path's run of an entry, whose Work it returns.
  py::object serve_run(const Steady& steady, const py::str& collective, int64_t numel,
                       py::handle tensor, py::handle output, const py::object& op,
                       const py::object& native);

  // What a served call counts and leaves (runner_count.h).
  void ran(const Steady& steady);
  std::optional<std::string> count_in_key_block();
  static void count_class(const py::object& model, const py::object& size_class);
  at::Tensor accumulator();
  py::object counted_in();
  int64_t logical_bytes(const py::str& collective, int64_t nbytes);
  void count(const Steady& steady, const py::str& collective, const at::Tensor& like,
             int64_t numel);
  int64_t next_ordinal(const py::str& collective, const at::Tensor& like, int64_t numel,
                       int64_t task);
  py::tuple exact_class(const py::str& collective, int64_t nbytes) const;
  void time_exact(const Steady& steady, const c10::intrusive_ptr<c10d::Work>& work,
                  const py::str& collective, const at::Tensor& like, int64_t numel,
                  std::chrono::steady_clock::time_point issued);
  py::object follow(const c10::intrusive_ptr<c10d::Work>& work, std::vector<at::Tensor> outputs,
                    bool checked = true);

  // A data movement's checks and its serving (runner_moves.h).
  bool moved(py::handle obj) const;
  bool splits_fit(py::handle splits, const at::Tensor& tensor, std::vector<int64_t>& sizes) const;
  static bool moved_dtype(at::ScalarType type);
  bool moves_here(bool described = true);
  enum class Point { kSend, kRecv, kRecvAnysource };
  py::object serve_point(Point kind, py::handle tensors, py::handle peer, py::handle tag);
  template <typename Issue>
  py::object serve_move(const std::vector<at::Tensor>& outputs, const at::Tensor& counted,
                        Issue&& issue, int64_t copies = 1);

  c10::intrusive_ptr<c10d::Backend> direct_;
  // the backend the group's data movements go to (runner_moves.h): the inner gloo group (a
  // device runner: its inner backend, `direct_`)
  c10::intrusive_ptr<c10d::Backend> inner_;
  // the group's issue lane (issue_lane.h; null: the inline issuer's group has none)
  std::shared_ptr<IssueLane> lane_;
  ModelTimings timings_;  // the runs it timed, not yet handed to the cost model
  py::object schedule_, compressed_, agreement_, issuer_, queue_, followed_, state_;
  py::object logical_bytes_, mode_stack_, key_stack_, policy_lock_, callback_context_;
  py::object tensor_type_, allreduce_options_type_, reduce_scatter_options_type_;
  py::object allgather_options_type_, broadcast_options_type_, alltoall_options_type_;
  py::object plan_core_, cpu_device_, encoder_thread_, sums_of_;
  at::Tensor sums_;
  // what its calls counted in the statistics (its Python object, which they watch), and the
  // statistics it counts in (`counted_in`)
  std::shared_ptr<ServedCounts> counts_ = std::make_shared<ServedCounts>();
  py::object counts_object_, counted_in_;
  // `logical_bytes`' answers by input bytes, for all-reduces and reduce-scatters (at most
  // `kLogicalKept` sizes each: a steady state has a few)
  static constexpr size_t kLogicalKept = 1024;
  std::unordered_map<int64_t, int64_t> logical_all_reduce_, logical_scatter_;
  std::string policy_;
  uint64_t main_thread_;
  int64_t world_, min_size_, timed_every_;
  bool issuer_counts_;
  // the device type it serves, by name (in the cost model's size classes) and by type; the
  // issuer's `canary` and `synced` (the Work of a call the inner backend ran synchronously and
  // returned none for), the group's `Reductions` (a compressed entry's run) and watchdog (None:
  // the CPU runner's, which has none of them);
  // whether it hands back the inner backend's own Work (a device runner) rather than a
  // `FollowedWork`
  py::str device_name_;
  c10::DeviceType device_type_;
  py::object canary_, reductions_, synced_, watchdog_;
  bool own_work_;
  // whether the group exchanges a descriptor before each CPU data movement, and its
  // `param_bits` (runner_moves.h: neither is served then)
  bool moves_checked_;
  int64_t param_bits_;
  // the gloo Works of the calls it served, kept a while (`follow`; retired_works.h), and the
  // thread that waits for its point-to-point calls (made at the first; point_completer.h)
  RetiredWorks retired_;
  std::unique_ptr<PointCompleter> points_;
  std::set<int64_t> native_ops_;
  py::str all_reduce_, reduce_scatter_, backward_, step_, compressed_name_;
  double decline_ = 0.0;
  std::mt19937_64 rng_;
  int64_t served_ = 0, served_compressed_ = 0, served_moves_ = 0;
};

}  // namespace lowbitcc

#include "runner_count.h"
#include "runner_device.h"
#include "runner_moves.h"
#include "runner_place.h"
#include "runner_planned.h"
