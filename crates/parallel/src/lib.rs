//! `parallel`: every parallelism of xtrain, one folder each (dp, zero, tp, pp, cp, ep),
//! all derived from one device mesh.
