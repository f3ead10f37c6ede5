// PlanCore: the steady run of one call place's compressed all-reduce or reduce-scatter on the
// CPU, in C++: what `call_plan.CallPlan.run` does on the direct schedule
// (lowbitcc/schedules/direct.py: the two ranks' all-reduce's all-gather, `_gather_all_reduce`;
// the reduce-scatter's all-to-all, `_pipeline`, on any number of ranks; the all-reduce on more
// ranks, `_pipeline` with its second phase, or `_scatter_gather`) and on the tree schedule
// (lowbitcc/schedules/tree.py) and the ring schedule (lowbitcc/schedules/ring.py), without Python.
//
// A place's plan gets one (lowbitcc/backend/plan_cores.py builds it from the plan's kept
// buffers and settings) where its runs are that schedule: an all-reduce or a reduce-scatter,
// nearest rounding, the C++ codec, with or without error feedback (each encode's state taken
// from the plan's store before the run and put back after its encodes: feedback_slots.h). Its
// transfers (`Piece`s) are the schedule's: a two ranks' all-reduce's, with one chunk one
// all-gather of both rows' messages, with several one per row and chunk; a reduce-scatter's one
// all-to-all of every row's messages per chunk; an all-reduce's on more ranks, per chunk that
// all-to-all and then an all-gather of each rank's message of its reduced row (its "second
// phase"). `run` is one call:
//   - in the calling thread, the GIL released, for each transfer: the header with the call
//     number, the encodes of its rows' columns of the source into its messages (codec_api.h),
//     their frames, and its transfer of the messages into its received buffer, started on the
//     plan's inner gloo group (so a chunk travels while the next is encoded);
//   - when a transfer completes, on the thread gloo completes it on: the messages it brought
//     verified against the call and decoded, summed in rank order (an all-reduce: each row's,
//     into the source; a reduce-scatter: this rank's row's, into the output), straight where
//     the target is fp32 and as wide, else through the plan's fp32 scratch and a cast, as the
//     Python schedule does;
//   - when every transfer is decoded: where a message did not belong to the call, the whole
//     decode is the Python plan's instead (`CallPlan.finish_received`, with the GIL): it writes
//     what the Python path writes and raises the same error, which the call's Work carries.
// An all-reduce on more ranks runs its first phase in the calling thread instead, in the
// schedule's order, so that every rank issues its transfers in one order whichever path each
// takes (gloo matches collectives by the order they are issued in): per chunk the encodes and
// the all-to-all started; once two are in flight the oldest awaited (the GIL released), its
// messages verified and summed into the scratch (a foreign one: NaN, as the Python decode
// leaves it), the sum encoded as this rank's message of the chunk and its all-gather started;
// once a message did not belong to the call, every message encoded after it is flagged
// `FLAG_PEER_ERROR` (lowbitcc/codec/wire.py), as `CallCompressor.encode` flags it. The
// all-gathers' decodes (each rank's reduced row into its place of the source, cast) run on
// gloo's threads, and the run's first phase ends once every all-gather is started. (The direct
// schedule's runs and decodes: direct_run.h.)
// A plan of the tree schedule (lowbitcc/schedules/tree.py) or of the ring schedule
// (lowbitcc/schedules/ring.py) runs whole in the calling thread instead, in the schedule's
// order: tree_run.h and ring_run.h (their runs' `Tree` and `Ring`: plan_pieces.h).
// A plan of the hierarchical schedule (lowbitcc/schedules/hierarchical.py) runs the node's exact
// steps around the direct schedule's pieces on its rail: hier_run.h (`Hier`: plan_pieces.h).
// Such a whole run (`runs_whole`: the tree's, the ring's, the hierarchical's, an all-reduce's two
// phases on more ranks) waits in its own transfers; where the group has an issue lane
// (issue_lane.h: the worker issuer's groups) it runs there, what is said above of the calling
// thread said of the lane's, and `run` returns once it is queued; but a synchronous call's (c10d's
// `asyncOp` false: its caller waits for it at once) runs on the calling thread all the same. The
// thread that issues a run's transfers (the issuing thread: the calling thread, or the lane) takes
// its error states before its first encode and puts them back after its last, with the GIL
// (feedback_slots.h), and counts the bytes it sent. The run's Work (`PlannedWork`) completes with
// the last decode, and not before the issuing thread is done with it. The same bytes as the Python
// path, on the same buffers, so a place's runs may take either path: one run of a place at a time
// (each run waits for the place's run before it, and the Python plan calls `wait` before its own).
//
// Threads: `run` is called with the GIL held (the caller's); the decodes run on gloo's threads
// (those that decode through the scratch one at a time, `scratch_mutex_`) and touch no Python
// object except in the failure path; a run on the lane takes the GIL for its error states (and,
// where a message does not belong to the call, for the Python plan's check and decode), never
// once the interpreter is finalizing (`python_running`, issue_lane.h). What a run measured
// (codec and wire seconds, the cost model's time) is kept here under `mutex_` and handed over
// once: the codec and wire seconds to the statistics by whichever comes first, a read of them
// (`take_seconds`, `counters.Stats` watches the core) or the runner at the place's next
// compressed call (`take_timings`), so a read after a call's wait counts its seconds; the cost
// model's times by the runner.
//
// Its members are defined by concept: how a core is made from its plan's spec (core_spec.h), its
// encodes (core_encode.h), its decodes' sums and a run's end (core_decide.h), a run's state
// (core_run.h) and its issuing (core_issue.h), and each schedule's run (direct_run.h,
// tree_run.h, ring_run.h, hier_run.h); the class and its members are here.
#pragma once

#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "codec_api.h"
#include "feedback_slots.h"
#include "issue_lane.h"
#include "plan_pieces.h"
#include "planned_work.h"
#include "served_counts.h"

namespace lowbitcc {

class __attribute__((visibility("hidden"))) PlanCore
    : public std::enable_shared_from_this<PlanCore> {
 public:
  // Made from the plan's spec (core_spec.h): `transport`: the gloo group its transfers travel
  // on (its Python object: the plan's inner group, or a hierarchical plan's rail's); `spec`:
  // plan_cores.py's `core_spec` (its docstring names each entry); `api`: the codec's
  // `codec_api` capsule; `park`: gloo_threads.py's `park`, which keeps what the core lets go
  // of on a gloo thread.
  PlanCore(py::object transport, py::dict spec, py::capsule api, py::object park);

  PlanCore(const PlanCore&) = delete;
  PlanCore& operator=(const PlanCore&) = delete;

  // Its last reference may go on gloo's thread (a run's callback): the Python objects it keeps
  // are let go with the GIL, and its gloo group, which must not be destroyed on one of its own
  // threads (gloo_threads.py), is parked for a Python thread to let go of.
  ~PlanCore() {
    transport_.reset();  // (not the group's last reference: its Python object holds one)
    if (hier_) {
      hier_->node.reset();  // (nor the node group's)
    }
    if (!python_running()) {
      plan_.release();
      size_class_.release();
      transport_object_.release();
      node_object_.release();
      deferred_errors_.release();
      park_.release();
      if (feedback_) {
        feedback_.release();  // (its Python objects: kept, the interpreter is gone)
      }
      return;
    }
    py::gil_scoped_acquire acquire;
    feedback_.reset();
    try {
      park_(transport_object_);
      if (node_object_) {
        park_(node_object_);
      }
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("lowbitcc: parking a plan core's gloo group");
    }
    transport_object_ = py::object();
    node_object_ = py::object();
    deferred_errors_ = py::object();
    park_ = py::object();
    plan_ = py::object();
    size_class_ = py::object();
  }

  // Whether a run of `tensor` (the call's source) into `output` (a reduce-scatter's; undefined:
  // an all-reduce), both checked by the runner to be dense CPU tensors (the output of the
  // input's dtype and a world's share of its elements), is this plan's: the source's dtype and
  // number of elements, both contiguous.
  bool fits(const at::Tensor& tensor, const at::Tensor& output) const {
    return tensor.scalar_type() == call_dtype_ && tensor.numel() == call_numel_ &&
           tensor.is_contiguous() && output.defined() == scatter_ &&
           (!scatter_ || output.is_contiguous());
  }

  bool modelled() const { return modelled_; }
  // Whether a run's output is kept as its place's canary (a plan off the direct schedule: the
  // tree's, the ring's and the hierarchical's, call_schedule.py).
  bool keeps_canary() const { return tree_.has_value() || ring_.has_value() || hier_.has_value(); }
  // Its runs' error states (null: feedback off).
  FeedbackSlots* feedback() const { return feedback_.get(); }
  const py::object& size_class() const { return size_class_; }
  int64_t nbytes() const { return nbytes_; }
  int64_t logical_bytes() const { return logical_bytes_; }

  // Wait (without the GIL: the caller releases it) until the place's last C++ run is done,
  // so that nothing else writes its buffers meanwhile. Its errors are its Work's, not this.
  void wait() {
    c10::intrusive_ptr<c10::ivalue::Future> last;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last = last_;
    }
    if (last) {
      last->wait();
    }
  }

  // One run: all-reduce `tensor` in place, or reduce-scatter it into `output`, as call number
  // `seq`; called with the GIL held; its Work (core_issue.h says what each argument is).
  c10::intrusive_ptr<c10d::Work> run(const at::Tensor& tensor, const at::Tensor& output,
                                     int64_t seq, at::Tensor sums, bool timed,
                                     std::shared_ptr<ServedCounts> counts,
                                     std::optional<FeedbackKey> key, IssueLane* lane,
                                     bool synchronous);

  // Whether its runs are whole (a tree's, a ring's, a hierarchical one's, an all-reduce's two
  // phases on more ranks): each waits in its own transfers, and runs on the issue lane where
  // the group has one.
  bool runs_whole() const {
    return two_phase_ || tree_.has_value() || ring_.has_value() || hier_.has_value();
  }

  // The codec and wire seconds runs measured since the last take (see the file's comment),
  // handed over once.
  std::pair<double, double> take_seconds() {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::pair<double, double> taken{timings_.codec_s, timings_.wire_s};
    timings_.codec_s = timings_.wire_s = 0.0;
    return taken;
  }

  // What runs measured since the last call (see the file's comment), handed over once.
  RunTimings take_timings() {
    std::lock_guard<std::mutex> lock(mutex_);
    RunTimings taken = std::move(timings_);
    timings_ = RunTimings();
    return taken;
  }

 private:
  // One run's own state, shared by its transfers' decodes (core_run.h).
  struct Run;

  // A run issued, its states taken and put back, and the bytes its transfers send counted; a
  // run's transfers awaited (core_issue.h).
  void issue(const std::shared_ptr<Run>& run, const at::Tensor& sums);
  bool take_states(Run& run);
  void end_encodes(Run& run);
  void sent_to(Run& run, int64_t peer, int64_t bytes) const;
  void sent_to_peers(Run& run, int64_t row_bytes) const;
  static void await_all(const std::vector<c10::intrusive_ptr<c10d::Work>>& started, Run& run);

  static double seconds(std::chrono::steady_clock::time_point a,
                        std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  // Nanoseconds from `a` to `b`, and from `begun` to now: what a run's encodes and decodes
  // add to its `encode_ns` and `decode_ns`.
  static int64_t nanos_between(std::chrono::steady_clock::time_point a,
                               std::chrono::steady_clock::time_point b) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
  }
  static int64_t nanos_since(std::chrono::steady_clock::time_point begun) {
    return nanos_between(begun, std::chrono::steady_clock::now());
  }

  // The encodes, and what they and `verify` found (core_encode.h).
  std::string encode(Piece& piece, Run& run, const at::Tensor& sums,
                     const at::Tensor& values = at::Tensor());
  void scaled_values(const Run& run, int64_t lo, int64_t hi, at::Tensor into) const;
  std::vector<size_t> encode_order() const;
  void apply_state(loco::EncodeArgs& a, Run& run, size_t slot) const;
  static void encoded(Run& run, bool nonfinite);
  static void received(Run& run, int64_t verdict);
  void flag_peer_error(const at::Tensor& messages) const;

  // The direct schedule's runs and their decodes (direct_run.h).
  void run_pieces(const std::shared_ptr<PlanCore>& self, const std::shared_ptr<Run>& run,
                  const at::Tensor& sums);
  void run_two_phases(const std::shared_ptr<PlanCore>& self, const std::shared_ptr<Run>& run,
                      const at::Tensor& sums);
  void gather(const std::shared_ptr<PlanCore>& self, const std::shared_ptr<Run>& run, size_t k,
              const std::string& header, const at::Tensor& sums);
  void decode_when_done(const std::shared_ptr<PlanCore>& self,
                        const c10::intrusive_ptr<c10d::Work>& transfer,
                        const std::shared_ptr<Run>& run, size_t k, const std::string& header);
  void decode_reduced_rows(const Piece& piece, const std::string& header, Run& run);
  void decode_rows(const Piece& piece, const std::string& header, Run& run);
  void decode_own_row(const Piece& piece, const std::string& header, Run& run);

  // The ring schedule's run and what it reads (ring_run.h).
  Piece read_row_encode(py::dict e, int64_t row0, int64_t a, int64_t b, int64_t shard,
                        const Piece& chunk);
  Ring read_ring(py::dict t);
  void run_ring(Run& run, const at::Tensor& sums);
  template <typename Send, typename Receive>
  void gather_ring(Ring& ring, Run& run, const at::Tensor& sums, Send& send, Receive& receive);
  void sum_arrived(Ring& ring, const at::Tensor& arrived, const Piece& chunk, int64_t shard,
                   at::Tensor target, Run& run);

  // The tree schedule's run and what it reads and decodes (tree_run.h); the tag of its
  // messages up (to the parent) and down (`tree.UP`, `tree.DOWN`).
  static constexpr int kUp = 0, kDown = 1;
  Tree read_tree(py::dict t);
  void run_tree(Run& run, const at::Tensor& sums);
  void sum_children(Tree& tree, const std::string& header, Run& run);
  void decode_codes(const at::Tensor& codes, const std::string& header, Run& run);

  // The hierarchical schedule's run and what it reads (hier_run.h).
  Hier read_hier(py::dict h);
  void run_hier(const std::shared_ptr<PlanCore>& self, const std::shared_ptr<Run>& run,
                const at::Tensor& sums);
  void node_gather(Run& run);
  void decode_rail_in_python(Run& run);
  static void await_decodes(Run& run);

  // `header` with call number `seq` (what `encode` writes its messages under).
  std::string call_header(std::string header, int64_t seq) const {
    const uint32_t seq32 = static_cast<uint32_t>(seq);
    std::memcpy(&header[seq_offset_], &seq32, 4);
    return header;
  }

  // The decodes' sums, and the run decided and completed (core_decide.h).
  void sum_messages(const at::Tensor& messages, int64_t width, int64_t shard,
                    const std::string& header, at::Tensor target, Run& run);
  bool accepts(const at::Tensor& messages, int64_t width, int64_t shard, int64_t seq);
  void sum_into(const at::Tensor& messages, int64_t width, at::Tensor target, int threads);
  void decided(Run& run);
  bool finish_in_python(const Run& run);
  static void complete(Run& run);

  c10::intrusive_ptr<c10d::Backend> transport_;
  py::object transport_object_, park_;  // the group's Python object; gloo_threads.park
  py::object node_object_;  // a hierarchical run's node group's Python object (else none)
  py::object deferred_errors_;  // what a hierarchical run's Python rail decodes raise when done
  py::object plan_;  // a weak reference: the plan keeps its core
  py::object size_class_;
  at::Tensor scratch_;
  at::ScalarType dtype_;
  at::ScalarType call_dtype_;  // the call's (a hierarchical core's `dtype_` is its rail's fp32)
  int64_t call_numel_ = 0;     // the call's (a hierarchical core's `numel_`: its rail's)
  bool scatter_;    // a reduce-scatter's core (else an all-reduce's)
  bool two_phase_;  // an all-reduce's on more than two ranks
  int64_t numel_, m_, world_, rank_, bits_, group_size_, format_, step_, seq_offset_;
  int64_t flags_offset_;
  uint8_t peer_error_flag_;
  double factor_, beta_;
  bool checksum_, modelled_;
  int64_t nbytes_, logical_bytes_;
  // by transport rank: whether it is on this rank's node (`MeteredTransport`'s `same_node`),
  // and how many of the others are, and are not
  std::vector<bool> same_node_;
  int64_t peers_inside_ = 0, peers_across_ = 0;
  std::vector<Piece> pieces_;
  std::optional<Tree> tree_;  // a tree schedule's run (then no `pieces_`)
  std::optional<Ring> ring_;  // a ring schedule's run (then no `pieces_`)
  std::optional<Hier> hier_;  // a hierarchical schedule's node steps (`pieces_`: its rail's)
  std::unique_ptr<FeedbackSlots> feedback_;  // null: feedback off
  const lowbitcc_cpu::CodecApi* api_ = nullptr;
  std::mutex mutex_, scratch_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> last_;
  RunTimings timings_;
};

}  // namespace lowbitcc

#include "core_run.h"
#include "core_decide.h"
#include "core_encode.h"
#include "core_issue.h"
#include "core_spec.h"
#include "direct_run.h"
#include "hier_run.h"
#include "ring_run.h"
#include "tree_run.h"
