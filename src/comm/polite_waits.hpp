// Polite waits: collectives issued from a thread that runs beside the training wait without
// taking a core. Internal; the asynchronous checkpoint's writer uses it (src/checkpoint/
// async_save.cpp), the MPI engine honours it (src/comm/mpi_collectives.cpp).
#pragma once

namespace shardopt::detail {

// Note [Polite waits]
// OpenMPI's blocking collectives wait by spinning in opal_progress: the thread that runs one
// holds a core until the last rank arrives. For the training's collectives that is what one
// wants (the core has nothing else to do, and the spin answers at once), but an asynchronous
// checkpoint's writer waits for the other ranks for much of its save (rank 0 writes the manifest
// and the commit while the others wait), and its spinning engine thread then takes a core from
// the steps the save was meant to overlap: perf of BERT-base at N = 2 put 0.13-0.16 s of such
// spinning per save on rank 1, more than the writer's own CPU (0.10 s). A thread that holds a
// PoliteWaits scope issues its collectives to be waited for politely: the MPI engine runs them
// as non-blocking MPI calls polled with MPI_Test and a sleep that grows from 20 us to 1 ms
// between polls. Deadlines are unchanged (Work::wait's timeout still ends a wait for a rank that
// never comes, Note [MPI timeouts]); engines that already block without spinning (threads, Gloo)
// ignore the scope. The cost is up to 1 ms of latency per collective, which a save's few dozen
// agreements do not notice and a training step would.
inline bool& polite_waits_flag() {
  static thread_local bool polite = false;
  return polite;
}

// Whether the calling thread asked for polite waits.
inline bool polite_waits_here() { return polite_waits_flag(); }

// Collectives issued on this thread while it lives wait politely (Note [Polite waits]).
class PoliteWaits {
 public:
  PoliteWaits() : before_(polite_waits_flag()) { polite_waits_flag() = true; }
  ~PoliteWaits() { polite_waits_flag() = before_; }
  PoliteWaits(const PoliteWaits&) = delete;
  PoliteWaits& operator=(const PoliteWaits&) = delete;

 private:
  bool before_;
};

}  // namespace shardopt::detail
