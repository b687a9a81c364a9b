//! Device mesh: world ranks laid out on named dimensions, last dimension fastest-varying
//! (row-major), e.g. `[("pp",2),("dp",2),("tp",2)]` puts tp neighbours on consecutive ranks.
//!
//! A group along a set of dimensions holds the ranks that share this rank's coordinates on
//! every *other* dimension; members are ordered by world rank (row-major over the chosen dims).
use std::collections::HashMap;
use std::sync::Mutex;

use crate::communicator::Communicator;
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;

/// The pure layout of a mesh (no communication).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshShape {
    names: Vec<String>,
    sizes: Vec<usize>,
}

impl MeshShape {
    /// `dims`: (name, size) pairs, outermost first.
    pub fn new(dims: &[(&str, usize)]) -> Result<Self> {
        let op = "MeshShape::new";
        if dims.is_empty() {
            return Err(CommError::invalid(
                op,
                "a mesh needs at least one dimension",
            ));
        }
        for (i, (name, size)) in dims.iter().enumerate() {
            if *size == 0 {
                return Err(CommError::invalid(
                    op,
                    format!("dimension {name:?} has size 0"),
                ));
            }
            if dims[..i].iter().any(|(n, _)| n == name) {
                return Err(CommError::invalid(
                    op,
                    format!("dimension {name:?} appears twice"),
                ));
            }
        }
        Ok(MeshShape {
            names: dims.iter().map(|d| d.0.to_string()).collect(),
            sizes: dims.iter().map(|d| d.1).collect(),
        })
    }

    /// Total number of ranks.
    pub fn numel(&self) -> usize {
        self.sizes.iter().product()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.sizes[self.dim(name)?])
    }

    fn dim(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            CommError::invalid(
                "DeviceMesh",
                format!("no dimension {name:?} in mesh {:?}", self.names),
            )
        })
    }

    /// Coordinates of `rank` (one per dimension).
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut c = vec![0; self.sizes.len()];
        let mut r = rank;
        for d in (0..self.sizes.len()).rev() {
            c[d] = r % self.sizes[d];
            r /= self.sizes[d];
        }
        c
    }

    /// Rank at `coords`.
    pub fn rank_of(&self, coords: &[usize]) -> usize {
        coords
            .iter()
            .zip(&self.sizes)
            .fold(0, |acc, (c, s)| acc * s + c)
    }

    /// Coordinate of `rank` along dimension `name`.
    pub fn coord(&self, rank: usize, name: &str) -> Result<usize> {
        Ok(self.coords(rank)[self.dim(name)?])
    }

    /// Members of `rank`'s group along `dims`, in increasing rank order.
    pub fn group_ranks(&self, dims: &[&str], rank: usize) -> Result<Vec<usize>> {
        let mut sel = vec![false; self.sizes.len()];
        for d in dims {
            let i = self.dim(d)?;
            if std::mem::replace(&mut sel[i], true) {
                return Err(CommError::invalid(
                    "DeviceMesh::group",
                    format!("dimension {d:?} listed twice"),
                ));
            }
        }
        let base = self.coords(rank);
        let mut out: Vec<usize> = (0..self.numel())
            .filter(|&r| {
                self.coords(r)
                    .iter()
                    .zip(&base)
                    .zip(&sel)
                    .all(|((c, b), s)| *s || c == b)
            })
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Every group along `dims` (each a list of ranks), ordered by their first rank.
    pub fn all_groups(&self, dims: &[&str]) -> Result<Vec<Vec<usize>>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.numel() {
            let g = self.group_ranks(dims, r)?;
            if g[0] == r {
                groups.push(g);
            }
        }
        Ok(groups)
    }
}

/// A mesh bound to a communicator: [`group`](Self::group) returns this rank's group along any
/// dimensions, created on first use (collectively by its members) and cached.
pub struct DeviceMesh {
    shape: MeshShape,
    comm: Communicator,
    cache: Mutex<HashMap<Vec<String>, ProcessGroup>>,
}

impl DeviceMesh {
    /// Lays the communicator's world out on `dims`; their product must equal the world size.
    pub fn new(comm: &Communicator, dims: &[(&str, usize)]) -> Result<Self> {
        let shape = MeshShape::new(dims)?;
        if shape.numel() != comm.size() {
            return Err(CommError::invalid(
                "DeviceMesh::new",
                format!(
                    "mesh {dims:?} has {} ranks but the world has {}",
                    shape.numel(),
                    comm.size()
                ),
            ));
        }
        Ok(DeviceMesh {
            shape,
            comm: comm.clone(),
            cache: Mutex::new(HashMap::new()),
        })
    }

    pub fn shape(&self) -> &MeshShape {
        &self.shape
    }

    /// This rank's coordinate along `name`.
    pub fn coord(&self, name: &str) -> Result<usize> {
        self.shape.coord(self.comm.rank(), name)
    }

    /// This rank's group along `dims` (e.g. `&["tp"]` or `&["dp", "cp"]`). Every member of the
    /// group must call this (in the same order relative to their other group creations).
    pub fn group(&self, dims: &[&str]) -> Result<ProcessGroup> {
        let mut key: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        key.sort();
        if let Some(g) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(g.clone());
        }
        let ranks = self.shape.group_ranks(dims, self.comm.rank())?;
        let g = self.comm.new_named_group(&dims.join("x"), &ranks)?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, g.clone());
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pp_dp_tp_layout() {
        let m = MeshShape::new(&[("pp", 2), ("dp", 2), ("tp", 2)]).unwrap();
        assert_eq!(m.coords(5), vec![1, 0, 1]);
        assert_eq!(m.rank_of(&[1, 0, 1]), 5);
        assert_eq!(
            m.all_groups(&["tp"]).unwrap(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            m.all_groups(&["dp"]).unwrap(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            m.all_groups(&["pp"]).unwrap(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            m.all_groups(&["dp", "tp"]).unwrap(),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            m.all_groups(&["pp", "tp"]).unwrap(),
            vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
        );
        assert_eq!(
            m.group_ranks(&["pp", "dp", "tp"], 3).unwrap(),
            (0..8).collect::<Vec<_>>()
        );
        assert!(m.group_ranks(&["cp"], 0).is_err());
        assert!(MeshShape::new(&[("a", 2), ("a", 2)]).is_err());
    }

    #[test]
    fn groups_partition_the_world() {
        let m = MeshShape::new(&[("pp", 2), ("dp", 3), ("cp", 2), ("tp", 2)]).unwrap();
        for dims in [&["tp"][..], &["cp"], &["dp", "cp"], &["pp"], &["dp"]] {
            let groups = m.all_groups(dims).unwrap();
            let size: usize = dims.iter().map(|d| m.size(d).unwrap()).product();
            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..m.numel()).collect::<Vec<_>>());
            assert!(groups.iter().all(|g| g.len() == size));
        }
        assert_eq!(
            m.group_ranks(&["dp", "cp"], 0).unwrap(),
            vec![0, 2, 4, 6, 8, 10]
        );
    }
}
