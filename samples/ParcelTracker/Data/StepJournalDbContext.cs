using Microsoft.EntityFrameworkCore;

namespace ParcelTracker.Data;

/// <summary>
/// The recorded steps' journal on SQLite only: steps are recorded on their own connection while the consumer's
/// transaction is open, and SQLite allows one writer per file, so the journal lives in a file of its own. On
/// PostgreSQL the journal is the <c>recorded_steps</c> table of <see cref="ParcelDbContext"/>.
/// </summary>
public sealed class StepJournalDbContext(DbContextOptions<StepJournalDbContext> options) : DbContext(options)
{
    protected override void OnModelCreating(ModelBuilder modelBuilder) => modelBuilder.AddExactlyOnceRecordedSteps();
}
