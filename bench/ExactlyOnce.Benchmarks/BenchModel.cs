using MassTransit;
using Microsoft.EntityFrameworkCore;

namespace ExactlyOnce.Benchmarks;

/// <summary>The business write every mode performs: one row per message, no unique constraint, so duplicates show.</summary>
public sealed class BenchRow
{
    public long Id { get; set; }
    public Guid Key { get; set; }
    public DateTime SentAt { get; set; }
    public int Phase { get; set; }
}

public sealed class BenchDbContext(DbContextOptions<BenchDbContext> options) : DbContext(options)
{
    public DbSet<BenchRow> Rows => Set<BenchRow>();

    protected override void OnModelCreating(ModelBuilder modelBuilder)
    {
        modelBuilder.Entity<BenchRow>(e =>
        {
            e.ToTable("bench_rows");
            e.Property(x => x.Id).HasColumnName("id");
            e.Property(x => x.Key).HasColumnName("key");
            e.Property(x => x.SentAt).HasColumnName("sent_at");
            e.Property(x => x.Phase).HasColumnName("phase");
            // When the row was written, by the database's clock (the publisher runs on the same machine).
            e.Property<DateTime>("WrittenAt").HasColumnName("written_at").HasDefaultValueSql("clock_timestamp()");
        });
        modelBuilder.AddExactlyOnceInbox();
    }
}

public sealed record BenchMessage(Guid Key, DateTime SentAt, int Phase);

/// <summary>The consumer of every MassTransit mode: insert one row and save.</summary>
public sealed class BenchConsumer(BenchDbContext db) : IConsumer<BenchMessage>
{
    public async Task Consume(ConsumeContext<BenchMessage> context)
    {
        db.Rows.Add(new BenchRow { Key = context.Message.Key, SentAt = context.Message.SentAt, Phase = context.Message.Phase });
        await db.SaveChangesAsync(context.CancellationToken);
    }
}
