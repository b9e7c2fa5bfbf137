// ParkingPool: pinned host pages for parked sessions, kept once pinned and handed out again;
// copies split at page ends give back exactly what went in; the budget is whole pages.
#include "tandem/gpu_worker/parking_pool.h"

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"

namespace tandem::gpu_worker {
namespace {

class ParkingPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing::MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
  }
  std::unique_ptr<Backend> backend_;
};

TEST_F(ParkingPoolTest, CopiesAcrossPageEndsRoundTrip) {
  ParkingPool pool(*backend_, 64 * 100, /*page_bytes=*/64, /*slab_pages=*/4);
  // 1000 bytes over 16 pages: rows of 300 bytes cross page ends at every offset mod 64.
  std::vector<uint8_t> host(1000);
  std::iota(host.begin(), host.end(), 1);
  auto device = backend_->Allocate(host.size());
  ASSERT_TRUE(device.ok());
  ASSERT_TRUE(backend_->CopyToDevice(device->data(), host.data(), host.size()).ok());
  auto space = pool.Take(host.size());
  ASSERT_TRUE(space.ok()) << space.status();
  EXPECT_EQ(space->bytes(), 1000u);
  EXPECT_EQ(space->held_bytes(), 16u * 64);
  EXPECT_EQ(pool.in_use_bytes(), 16u * 64);
  for (size_t offset = 0; offset < host.size(); offset += 300) {
    const size_t n = std::min<size_t>(300, host.size() - offset);
    ASSERT_TRUE(space->CopyFromDevice(offset, device->as<char>() + offset, n).ok());
  }
  auto back = backend_->Allocate(host.size());
  ASSERT_TRUE(back.ok());
  ASSERT_TRUE(space->CopyToDevice(back->data(), 0, 1000).ok());
  std::vector<uint8_t> got(host.size());
  ASSERT_TRUE(backend_->CopyToHost(got.data(), back->data(), got.size()).ok());
  EXPECT_EQ(got, host);
  // Out of its range: refused.
  EXPECT_EQ(space->CopyFromDevice(900, device->data(), 101).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(space->CopyToDevice(back->data(), 1, 1000).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ParkingPoolTest, PagesAreKeptAndReusedWithinTheBudget) {
  ParkingPool pool(*backend_, 64 * 10, 64, 4);
  auto a = pool.Take(64 * 3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.pinned_bytes(), 64u * 4);   // one slab
  auto b = pool.Take(64 * 6 + 1);            // 7 pages: two more slabs, the last cut at 10
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(pool.in_use_bytes(), 64u * 10);
  EXPECT_EQ(pool.pinned_bytes(), 64u * 10);
  auto over = pool.Take(1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  a->Release();
  EXPECT_FALSE(a->held());
  EXPECT_EQ(pool.in_use_bytes(), 64u * 7);
  {
    auto c = pool.Take(64 * 3);   // the pages `a` gave back: nothing more pinned
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(pool.pinned_bytes(), 64u * 10);
    ParkingSpace moved = std::move(*c);
    EXPECT_TRUE(moved.held());
    EXPECT_EQ(pool.in_use_bytes(), 64u * 10);
  }   // destroyed: back to the pool
  EXPECT_EQ(pool.in_use_bytes(), 64u * 7);
  ParkingPool none(*backend_, 0);
  EXPECT_EQ(none.Take(1).status().code(), absl::StatusCode::kResourceExhausted);
}

// Strided rows (a tensor's heads): packed in the space, rows within a page in one 2D copy and
// rows across page ends in pieces; back to a device tensor of another pitch, exactly.
TEST_F(ParkingPoolTest, StridedRowsRoundTripAcrossPageEnds) {
  ParkingPool pool(*backend_, 64 * 100, /*page_bytes=*/64, /*slab_pages=*/4);
  constexpr size_t kRows = 9, kRow = 24, kPitch = 40, kOffset = 50;   // rows cross page ends
  std::vector<uint8_t> host(kRows * kPitch);
  std::iota(host.begin(), host.end(), 3);
  auto device = backend_->Allocate(host.size());
  ASSERT_TRUE(device.ok());
  ASSERT_TRUE(backend_->CopyToDevice(device->data(), host.data(), host.size()).ok());
  auto space = pool.Take(kOffset + kRows * kRow);
  ASSERT_TRUE(space.ok()) << space.status();
  ASSERT_TRUE(space->CopyRowsFromDevice(kOffset, device->data(), kPitch, kRow, kRows).ok());
  // Packed: row r at kOffset + r·kRow, read back whole.
  auto packed = backend_->Allocate(kRows * kRow);
  ASSERT_TRUE(packed.ok());
  ASSERT_TRUE(space->CopyToDevice(packed->data(), kOffset, kRows * kRow).ok());
  std::vector<uint8_t> got(kRows * kRow);
  ASSERT_TRUE(backend_->CopyToHost(got.data(), packed->data(), got.size()).ok());
  for (size_t r = 0; r < kRows; ++r) {
    for (size_t b = 0; b < kRow; ++b) ASSERT_EQ(got[r * kRow + b], host[r * kPitch + b]);
  }
  // Back to a tensor of pitch 32 (zeroed first): each row in place, the gaps untouched.
  constexpr size_t kBackPitch = 32;
  std::vector<uint8_t> zeros(kRows * kBackPitch, 0);
  auto back = backend_->Allocate(zeros.size());
  ASSERT_TRUE(back.ok());
  ASSERT_TRUE(backend_->CopyToDevice(back->data(), zeros.data(), zeros.size()).ok());
  ASSERT_TRUE(space->CopyRowsToDevice(back->data(), kBackPitch, kOffset, kRow, kRows).ok());
  std::vector<uint8_t> out(zeros.size());
  ASSERT_TRUE(backend_->CopyToHost(out.data(), back->data(), out.size()).ok());
  for (size_t r = 0; r < kRows; ++r) {
    for (size_t b = 0; b < kBackPitch; ++b) {
      ASSERT_EQ(out[r * kBackPitch + b], b < kRow ? host[r * kPitch + b] : 0) << r << " " << b;
    }
  }
  EXPECT_EQ(space->CopyRowsFromDevice(kOffset + 1, device->data(), kPitch, kRow, kRows).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
