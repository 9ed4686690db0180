//! The wire protocol every transport shares: one definition of the LL line, the call header,
//! the inbox layout, chunking and the reduction order. Nothing here does I/O, so each piece is
//! unit- and property-tested on its own; the CPU backend and the GPU kernels implement exactly
//! this format.
//!
//! A call (one allreduce) is cut into chunks that fit the inbox; each chunk uses one *epoch*.
//! The epoch selects one of [`layout::BUFFERS`] rotating buffers and the [`line::Tag`] every line
//! of that chunk carries. A reader knows a line has arrived when its tag is the current one:
//! the data is the signal, so there is no separate barrier and nothing is ever cleared.

pub mod header;
pub mod layout;
pub mod line;
pub mod reduce;
pub mod schedule;
