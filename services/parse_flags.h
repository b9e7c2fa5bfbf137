// Command-line parsing shared by tandem's executables (services and benchmarks):
// - a bad command line exits with status 2 everywhere, --help and --version with 0. absl::ParseCommandLine itself ends the
//   process with status 1 on a bad flag (an unknown name, a value that does not parse), so an
//   exit while it runs is turned into 2; --help and --version end the process from inside the
//   parser with absl's status 1, turned into 0;
// - --help lists the flags defined in tandem's own sources (absl's default shows only those of
//   a file named like the binary, which printed "No flags matched" for most of them);
// - hyphens and underscores are the same in flag names: --max-batch=8 is --max_batch=8.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <cstring>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace tandem::services {

inline bool parsing_flags = false;   // true while ParseCommandLineOrExitTwo is parsing
inline bool printing_help = false;   // --help / --version: absl prints and exits (with 1)

// At exit: a bad flag ends with 2; help and version, which absl ends with 1, with 0 (after
// flushing what absl printed: _Exit skips the flush exit() would do after this handler).
inline void ExitTwoIfParsing() {
  if (printing_help) {
    std::cout.flush();
    std::fflush(nullptr);
    std::_Exit(0);
  }
  if (parsing_flags) std::_Exit(2);
}

// True when argv[1..argc) asks for --help / --helpfull / ... or --version.
inline bool AsksForHelp(int argc, char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (absl::StartsWith(arg, "--help") || absl::StartsWith(arg, "-help") || arg == "--version" ||
        arg == "-version") {
      return true;
    }
  }
  return false;
}

// Rewrites the name part of every "-name[=value]" / "--name[=value]" argument (before "=", up to
// a bare "--") with underscores for hyphens, in place.
inline void NormalizeFlagNames(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* arg = argv[i];
    if (arg[0] != '-' || arg[1] == '\0') continue;
    if (std::strcmp(arg, "--") == 0) break;
    for (char* c = arg + (arg[1] == '-' ? 2 : 1); *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

// Flags worth listing in --help: those defined in tandem's sources, not absl's or gRPC's.
inline bool IsTandemFlagFile(absl::string_view file) {
  for (absl::string_view dir : {"services/", "bench/", "gpu_worker/", "cpu_attention/",
                                "kv_store/", "common/", "tests/"}) {
    if (absl::StrContains(file, dir)) return true;
  }
  return false;
}

inline void ConfigureFlagUsage() {
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = IsTandemFlagFile;
  config.contains_help_flags = IsTandemFlagFile;
  absl::SetFlagsUsageConfig(config);
}

// absl::ParseCommandLine(argc, argv) that exits with status 2 instead of 1 on a bad flag, with
// the help and spelling rules above. Returns the positional arguments (argv[0] first).
inline std::vector<char*> ParseCommandLineOrExitTwo(int argc, char** argv) {
  static const bool registered = std::atexit(ExitTwoIfParsing) == 0;
  (void)registered;
  ConfigureFlagUsage();
  NormalizeFlagNames(argc, argv);
  printing_help = AsksForHelp(argc, argv);
  parsing_flags = !printing_help;
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  parsing_flags = false;
  printing_help = false;
  return positional;
}

}  // namespace tandem::services
