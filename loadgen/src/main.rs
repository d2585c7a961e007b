//! loadgen (being written)
fn main() {}
