// The service mains' stop signals (SIGINT, SIGTERM): blocked in every thread and taken by the
// main thread (sigwait) for a graceful stop.
#pragma once

#include <pthread.h>

#include <csignal>

namespace tandem::services {

// Blocks SIGINT and SIGTERM in the calling thread and returns the set for sigwait.
// NOTE: call it first in main(), before anything can start a thread: a thread inherits the mask
// its creator has, and gRPC starts executor and timer threads while flags and logging are set
// up. One of those with SIGTERM unblocked can take a SIGTERM, whose default action ends the
// process (status 143) instead of the drain that sigwait starts.
inline sigset_t BlockStopSignals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  return stop_signals;
}

}  // namespace tandem::services
