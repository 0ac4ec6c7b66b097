//! The real XDP program on crafted frames (BPF_PROG_TEST_RUN), fixture
//! style: input frame from the builder, expected verdict, expected bytes.
//! One module per concern, named as its namespace test in `tests/netns/`.

mod fixture;

mod budget;
mod closes;
mod dsr;
mod forward;
mod fuzz;
mod halfopen;
mod icmp;
mod ipv6;
mod latency;
mod lifecycle;
mod maglev;
mod nat;
mod offload;
mod retry;
mod ring;
mod snat;
mod udp;
