// Logging set-up shared by the services' main(): logs go to stderr under the program's name
// (stdout carries only the LISTENING line scripts wait for), at the level of --log_level.
#pragma once

#include <cstdio>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace tandem::services {

// Installs the stderr logger named `program` at `level` (trace, debug, info, warn, error or
// off). Returns false, after printing why, for any other level: main() then exits with 2.
inline bool ConfigureStderrLogging(const char* program, const std::string& level) {
  spdlog::set_default_logger(spdlog::stderr_color_mt(program));
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    std::fprintf(stderr, "%s: --log_level must be trace, debug, info, warn, error or off\n",
                 program);
    return false;
  }
  spdlog::set_level(parsed);
  return true;
}

}  // namespace tandem::services
