//! Durable ids for engine names and partition keys.
//!
//! Rows name engines and partitions by u32 ids rather than strings (a block row holds 5 bytes
//! per holder instead of a name), and the ids must mean the same after a restart and whatever
//! the order shards intern in, so they are allocated here, store-wide, and persisted in `meta`.
//! The registry is append-only: an id is never reused, even if the commit that allocated it
//! failed (such a batch may still surface from the WAL at recovery, carrying the row).
//!
//! An id is usable by a commit only once its registry row is durable no later than the rows
//! that use it. So a commit that allocates ids writes the registry rows in its own batch and
//! keeps the registry locked until that batch is written; ids whose rows are not yet written
//! (`unwritten`) are rewritten by the next commit, whichever shard it is from.

use std::hash::Hash;

/// One id space (engine names or partition keys).
#[derive(Debug)]
pub struct Ids<K> {
    by_id: Vec<Option<K>>,
    ids: hashbrown::HashMap<K, u32>,
    /// Allocated ids whose rows no batch has written yet.
    unwritten: Vec<u32>,
}

impl<K> Default for Ids<K> {
    fn default() -> Self {
        Ids {
            by_id: Vec::new(),
            ids: hashbrown::HashMap::new(),
            unwritten: Vec::new(),
        }
    }
}

impl<K: Hash + Eq + Clone> Ids<K> {
    /// Registers a row read back from the store.
    pub fn load(&mut self, id: u32, key: K) {
        let i = id as usize;
        if self.by_id.len() <= i {
            self.by_id.resize(i + 1, None);
        }
        self.by_id[i] = Some(key.clone());
        self.ids.insert(key, id);
    }

    #[cfg(test)]
    pub fn get<Q>(&self, key: &Q) -> Option<u32>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.ids.get(key).copied()
    }

    /// The id of `key` if its row is durable (allocated and written).
    pub fn written_id<Q>(&self, key: &Q) -> Option<u32>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.ids
            .get(key)
            .copied()
            .filter(|id| !self.unwritten.contains(id))
    }

    /// The id of `key`, allocating the next one (and marking it unwritten) if it has none.
    pub fn id_or_insert(&mut self, key: &K) -> u32 {
        if let Some(&id) = self.ids.get(key) {
            return id;
        }
        let id = self.by_id.len() as u32;
        self.by_id.push(Some(key.clone()));
        self.ids.insert(key.clone(), id);
        self.unwritten.push(id);
        id
    }

    pub fn key(&self, id: u32) -> Option<&K> {
        self.by_id.get(id as usize)?.as_ref()
    }

    pub fn unwritten(&self) -> impl Iterator<Item = (u32, &K)> + '_ {
        self.unwritten
            .iter()
            .filter_map(|&id| Some((id, self.key(id)?)))
    }

    pub fn has_unwritten(&self) -> bool {
        !self.unwritten.is_empty()
    }

    pub fn mark_written(&mut self) {
        self.unwritten.clear();
    }
}

/// Both id spaces, behind the store's one registry mutex.
#[derive(Debug, Default)]
pub struct Registry {
    pub engines: Ids<std::sync::Arc<str>>,
    pub partitions: Ids<crate::event::PartitionKey>,
}

impl Registry {
    pub fn has_unwritten(&self) -> bool {
        self.engines.has_unwritten() || self.partitions.has_unwritten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn ids_are_dense_stable_and_never_reused() {
        let mut ids: Ids<Arc<str>> = Ids::default();
        ids.load(0, Arc::from("a"));
        ids.load(3, Arc::from("b"));
        assert_eq!(ids.get("b"), Some(3));
        assert_eq!(ids.id_or_insert(&Arc::from("c")), 4);
        assert_eq!(ids.id_or_insert(&Arc::from("a")), 0);
        assert_eq!(ids.unwritten().map(|(i, _)| i).collect::<Vec<_>>(), vec![4]);
        ids.mark_written();
        assert!(!ids.has_unwritten());
        assert_eq!(ids.key(4).map(|k| &**k), Some("c"));
        assert_eq!(ids.key(2), None);
    }
}
