//! What a packet is: the address families' shape and the bounds-checked
//! parse of a frame's headers.

pub mod family;
pub mod parse;
pub mod partial;
pub mod tcp;
