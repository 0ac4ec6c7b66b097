//! Balancer configuration: the TOML file form, the command-line form, and
//! the validation both go through. Every error names the field (and, for a
//! file, the line) so a bad config never gets as far as the kernel.

mod checks;
mod file;
pub mod key;
pub mod locate;
mod model;
mod probe;
#[cfg(test)]
mod probe_tests;
mod settings;
#[cfg(test)]
mod tests;
pub mod tuning;
pub mod url;
mod validate;
mod values;

// One `config::` namespace for the types every layer names.
pub use file::*;
pub use locate::Origin;
pub use model::*;
pub use values::*;
