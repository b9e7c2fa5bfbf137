// tandem::cpu_isa: parsing TANDEM_CPU_ISA, the cap it puts on the active set, and oneDNN's
// error statuses (tandem/common/dnnl_call.h), which must read as sentences, not source code.
#include "tandem/cpu_isa/cpu_isa.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "scoped_cpu_isa.h"
#include "tandem/common/dnnl_call.h"

namespace tandem {
namespace {

using ::tandem::testing::ScopedCpuIsa;

TEST(CpuIsaTest, ParsesTheThreeSetsAndNamesThemBack) {
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    const absl::StatusOr<CpuIsa> parsed = ParseCpuIsa(CpuIsaName(isa));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, isa);
  }
  EXPECT_EQ(*ParseCpuIsa("AVX2"), CpuIsa::kAvx2);
  const absl::StatusOr<CpuIsa> bad = ParseCpuIsa("avx3");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("portable, avx2 or avx512"),
            std::string::npos);
}

TEST(CpuIsaTest, TheVariableCapsButNeverRaisesTheNativeSet) {
  const CpuIsa native = NativeCpuIsa();
  {
    ScopedCpuIsa isa("");
    EXPECT_EQ(ActiveCpuIsa(), native);
    EXPECT_FALSE(CpuIsaForcedBelowNative());
    EXPECT_TRUE(CheckCpuIsaEnvironment().ok());
  }
  {
    ScopedCpuIsa isa("portable");
    EXPECT_EQ(ActiveCpuIsa(), CpuIsa::kPortable);
    EXPECT_EQ(CpuIsaForcedBelowNative(), native != CpuIsa::kPortable);
    EXPECT_NE(CpuIsaSummary().find("CPU kernels: portable"), std::string::npos) << CpuIsaSummary();
  }
  {
    ScopedCpuIsa isa("avx2");
    EXPECT_EQ(ActiveCpuIsa(), std::min(native, CpuIsa::kAvx2));
  }
  {
    ScopedCpuIsa isa("avx512");
    EXPECT_EQ(ActiveCpuIsa(), native);
  }
  {
    // A typo keeps the native set (no silent downgrade) and start-up checks refuse it.
    ScopedCpuIsa isa("avx-2");
    EXPECT_EQ(ActiveCpuIsa(), native);
    EXPECT_EQ(CheckCpuIsaEnvironment().code(), absl::StatusCode::kInvalidArgument);
  }
}

absl::Status FailingPrimitive() {
  TANDEM_DNNL_CALL("creating a test matmul [2, 3] x [4, 5]", {
    using dt = dnnl::memory::data_type;
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc src({2, 3}, dt::f32, {3, 1});
    const dnnl::memory::desc wei({4, 5}, dt::f32, {5, 1});  // k mismatch: oneDNN refuses
    const dnnl::memory::desc dst({2, 5}, dt::f32, {5, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), engine);
  });
  return absl::OkStatus();
}

// Under an emulated CPU (the avx2_cpu.* ctest tests, cmake/TandemHelpers.cmake), the set the
// runner expects the CPU to report: if qemu's CPU model ever gained AVX-512, those tests would
// quietly repeat the native path, so this one fails instead.
TEST(CpuIsaTest, TheNativeSetIsWhatTheEmulatedCpuReports) {
  const char* expected = std::getenv("TANDEM_EXPECT_NATIVE_CPU_ISA");
  if (expected == nullptr) {
    GTEST_SKIP() << "TANDEM_EXPECT_NATIVE_CPU_ISA is not set (only the avx2_cpu.* runs set it)";
  }
  EXPECT_STREQ(CpuIsaName(NativeCpuIsa()), expected);
}

TEST(DnnlCallTest, AFailureSaysWhatWasDoneAndNeverQuotesSource) {
  const absl::Status status = FailingPrimitive();
  ASSERT_FALSE(status.ok());
  const std::string message(status.message());
  EXPECT_EQ(message.rfind("creating a test matmul [2, 3] x [4, 5]: oneDNN failed", 0), 0u)
      << message;
  EXPECT_EQ(message.find("primitive_desc"), std::string::npos) << message;
  EXPECT_EQ(message.find(".cc:"), std::string::npos) << message;
}

TEST(DnnlCallTest, UnimplementedSaysWhatItMeans) {
  const absl::Status status =
      DnnlStatusToStatus("creating a bf16 matmul", dnnl_unimplemented, "no implementation");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(std::string(status.message()).find("no kernel for these data types on this CPU"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem
