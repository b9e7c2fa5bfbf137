// Command-line parsing shared by tandem's executables: a bad command line exits with status 2
// everywhere. absl::ParseCommandLine itself ends the process with status 1 on a bad flag (an
// unknown name, a value that does not parse), so an exit while it runs is turned into 2;
// --help and --version also end the process from inside the parser and keep absl's status.
#pragma once

#include <cstdlib>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace tandem::services {

inline bool parsing_flags = false;   // true while ParseCommandLineOrExitTwo is parsing

inline void ExitTwoIfParsing() {
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

// absl::ParseCommandLine(argc, argv) that exits with status 2 instead of 1 on a bad flag.
// Returns the positional arguments (argv[0] first).
inline std::vector<char*> ParseCommandLineOrExitTwo(int argc, char** argv) {
  static const bool registered = std::atexit(ExitTwoIfParsing) == 0;
  (void)registered;
  parsing_flags = !AsksForHelp(argc, argv);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  parsing_flags = false;
  return positional;
}

}  // namespace tandem::services
