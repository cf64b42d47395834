//! Which ranks share a node, and the node-major order the hierarchical reduction folds in.

/// The nodes of a job and each rank's place in them.
///
/// Nodes are numbered by their lowest global rank (the node of rank 0 is node 0), and the ranks
/// of a node by increasing global rank (its local ranks). The node-major order lists node 0's
/// ranks, then node 1's, and so on: the order every reduction of the hierarchical backend
/// combines its inputs in. It is the global rank order when the launcher places ranks in blocks
/// (srun's and `mpiexec -ppn`'s default), and differs from it when ranks are dealt round-robin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Global ranks of each node, in local rank order.
    pub nodes: Vec<Vec<usize>>,
    /// `(node, local rank)` of each global rank.
    pub place: Vec<(usize, usize)>,
}

impl Layout {
    /// The layout where rank `g` shares a node with the ranks whose `leader_of` (the lowest global
    /// rank of its node, as every rank reported) is the same.
    pub fn from_leaders(leader_of: &[usize]) -> Result<Layout, String> {
        let mut nodes: Vec<Vec<usize>> = Vec::new();
        let mut place = vec![(0, 0); leader_of.len()];
        for (g, &l) in leader_of.iter().enumerate() {
            if l > g || leader_of.get(l) != Some(&l) {
                return Err(format!(
                    "rank {g} reports rank {l} as the lowest rank of its node, but that rank reports {:?}: the ranks disagree on who shares a node",
                    leader_of.get(l)
                ));
            }
            if l == g {
                nodes.push(vec![g]);
                place[g] = (nodes.len() - 1, 0);
            } else {
                let k = place[l].0;
                place[g] = (k, nodes[k].len());
                nodes[k].push(g);
            }
        }
        Ok(Layout { nodes, place })
    }

    /// Global rank of local rank `local` of node `node`.
    pub fn global(&self, node: usize, local: usize) -> usize {
        self.nodes[node][local]
    }

    /// Global ranks in node-major order.
    pub fn order(&self) -> Vec<usize> {
        self.nodes.iter().flatten().copied().collect()
    }

    /// Number of rails: local ranks `0..rails()` exist on every node.
    pub fn rails(&self) -> usize {
        self.nodes.iter().map(Vec::len).min().unwrap_or(1)
    }

    /// Whether the node-major order is the global rank order.
    pub fn is_blocked(&self) -> bool {
        self.order().iter().enumerate().all(|(i, &g)| i == g)
    }
}

/// `n` elements cut into `parts` contiguous slices as even as possible (the first `n % parts`
/// one element longer): `(start, len)` of each.
pub(crate) fn slices(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.max(1);
    let (base, extra) = (n / parts, n % parts);
    let mut at = 0;
    (0..parts)
        .map(|j| {
            let len = base + usize::from(j < extra);
            let s = (at, len);
            at += len;
            s
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_and_blocks() {
        // MPICH's cliques deal ranks round-robin: 0 and 2 on one node, 1 and 3 on the other.
        let l = Layout::from_leaders(&[0, 1, 0, 1]).unwrap();
        assert_eq!(l.nodes, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(l.place, vec![(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert_eq!(l.order(), vec![0, 2, 1, 3]);
        assert!(!l.is_blocked());
        let b = Layout::from_leaders(&[0, 0, 2, 2, 2]).unwrap();
        assert_eq!(b.order(), vec![0, 1, 2, 3, 4]);
        assert!(b.is_blocked());
        assert_eq!(b.rails(), 2);
        assert!(Layout::from_leaders(&[0, 2, 1]).is_err());
        assert_eq!(slices(10, 3), vec![(0, 4), (4, 3), (7, 3)]);
        assert_eq!(slices(1, 2), vec![(0, 1), (1, 0)]);
    }
}
