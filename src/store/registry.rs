//! Durable ids for engine names and partition keys.
//!
//! Rows name engines and partitions by u32 ids rather than strings (a block row holds 5 bytes
//! per holder instead of a name), and the ids must mean the same after a restart and whatever
//! the order shards intern in, so they are allocated here, store-wide, and persisted in `meta`.
//!
//! An id is usable by a commit only once its registry row is durable no later than the rows
//! that use it. So a commit that allocates ids writes the registry rows in its own batch and
//! keeps the registry locked until that batch is written; ids whose rows are not yet written
//! (`unwritten`) are rewritten by the next commit, whichever shard it is from.
//!
//! An id is *released* when the last shard row naming it (a shard's engine or partition row,
//! which every other row of that shard naming the id comes with) is deleted: the batch that
//! deletes that row deletes the registry rows too, and once it is written the id is free for
//! the next name. Commits that add or delete shard rows also hold the registry lock until
//! written, so the count of shard rows per id (`users`) is exact whenever the lock is free.
//! An id allocated by a commit that failed is never released by that failure (its batch may
//! still surface from the WAL at recovery): only a later successful deletion releases it.

use std::hash::Hash;

/// One id space (engine names or partition keys).
#[derive(Debug)]
pub struct Ids<K> {
    by_id: Vec<Option<K>>,
    ids: hashbrown::HashMap<K, u32>,
    /// Allocated ids whose rows no batch has written yet.
    unwritten: Vec<u32>,
    /// (shard, id) of every shard row naming an id, and per id how many there are.
    rows: hashbrown::HashSet<(u16, u32)>,
    users: hashbrown::HashMap<u32, u32>,
    /// Released ids, reused before new ones.
    free: Vec<u32>,
}

impl<K> Default for Ids<K> {
    fn default() -> Self {
        Ids {
            by_id: Vec::new(),
            ids: hashbrown::HashMap::new(),
            unwritten: Vec::new(),
            rows: hashbrown::HashSet::new(),
            users: hashbrown::HashMap::new(),
            free: Vec::new(),
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

    /// After every [`Ids::load`]: ids below the highest that no row names are free.
    pub fn loaded(&mut self) {
        self.free = (0..self.by_id.len() as u32)
            .rev()
            .filter(|&i| self.by_id[i as usize].is_none())
            .collect();
    }

    /// Whether shard `shard` has a row naming `id`.
    pub fn has_row(&self, shard: u16, id: u32) -> bool {
        self.rows.contains(&(shard, id))
    }

    /// Records a shard row naming `id` (read back, or written by a commit).
    pub fn add_row(&mut self, shard: u16, id: u32) {
        if self.rows.insert((shard, id)) {
            *self.users.entry(id).or_default() += 1;
        }
    }

    /// Shard rows naming `id`, in every shard.
    pub fn users(&self, id: u32) -> u32 {
        self.users.get(&id).copied().unwrap_or(0)
    }

    /// Records that shard `shard`'s row naming `id` was deleted.
    pub fn remove_row(&mut self, shard: u16, id: u32) {
        if self.rows.remove(&(shard, id))
            && let Some(n) = self.users.get_mut(&id)
        {
            *n -= 1;
            if *n == 0 {
                self.users.remove(&id);
            }
        }
    }

    /// Frees `id` (its registry rows were deleted, and no row names it): the next new key
    /// may take it.
    pub fn release(&mut self, id: u32) {
        if let Some(key) = self.by_id.get_mut(id as usize).and_then(Option::take) {
            self.ids.remove(&key);
            self.unwritten.retain(|&u| u != id);
            self.free.push(id);
        }
    }

    /// Keys with an id (allocated, written or not).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `key`, if it has one (allocating nothing).
    pub fn id<Q>(&self, key: &Q) -> Option<u32>
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

    /// The id of `key`, allocating one (a released one first; marked unwritten) if it has none.
    pub fn id_or_insert(&mut self, key: &K) -> u32 {
        if let Some(&id) = self.ids.get(key) {
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.by_id[id as usize] = Some(key.clone());
                id
            }
            None => {
                self.by_id.push(Some(key.clone()));
                (self.by_id.len() - 1) as u32
            }
        };
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
    fn ids_are_dense_and_stable_until_released() {
        let mut ids: Ids<Arc<str>> = Ids::default();
        ids.load(0, Arc::from("a"));
        ids.load(3, Arc::from("b"));
        ids.loaded();
        assert_eq!(ids.id("b"), Some(3));
        assert_eq!(ids.id_or_insert(&Arc::from("c")), 1, "a gap is free");
        assert_eq!(ids.id_or_insert(&Arc::from("a")), 0);
        assert_eq!(ids.unwritten().map(|(i, _)| i).collect::<Vec<_>>(), vec![1]);
        ids.mark_written();
        assert!(!ids.has_unwritten());
        assert_eq!(ids.key(1).map(|k| &**k), Some("c"));
        assert_eq!(ids.key(2), None);

        // Rows are counted per (shard, id): a second row of one shard is the same row.
        ids.add_row(0, 3);
        ids.add_row(0, 3);
        ids.add_row(1, 3);
        assert_eq!(ids.users(3), 2);
        ids.remove_row(0, 3);
        assert_eq!(ids.users(3), 1);
        assert!(ids.has_row(1, 3) && !ids.has_row(0, 3));
        ids.remove_row(1, 3);
        assert_eq!(ids.users(3), 0);
        ids.release(3);
        assert_eq!(ids.id("b"), None);
        assert_eq!(
            ids.id_or_insert(&Arc::from("d")),
            3,
            "a released id is reused"
        );
        assert_eq!(ids.id_or_insert(&Arc::from("e")), 2);
        assert_eq!(ids.id_or_insert(&Arc::from("f")), 4);
    }
}
