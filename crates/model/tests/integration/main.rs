//! The model crate's integration tests, one binary (one link, one instantiation of the
//! generic code they share); each module is one subject. Tests that need a process of
//! their own (GPU tests, thread counting) stay separate files beside this folder.
mod behaviour;
mod documents;
mod golden;
mod gradcheck;
mod tensor_parallel;
